def read_line(line: str) -> list[str]:
    return line.rstrip("\n").split(",")
