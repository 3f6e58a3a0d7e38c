def initials(name: str) -> str:
    return "".join(word[0].upper() for word in name.split(" "))


def surname(name: str) -> str:
    return name.split()[-1]
