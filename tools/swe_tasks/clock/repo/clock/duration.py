def format_duration(seconds: int) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{minutes}:{secs}"


def parse_duration(text: str) -> int:
    minutes, secs = text.split(":")
    return int(minutes) * 60 + int(secs)
