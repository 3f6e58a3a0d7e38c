import re


def has_digit(text: str) -> bool:
    return re.match(r"\d", text) is not None


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)
