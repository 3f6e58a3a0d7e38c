def write_line(fields: list[str]) -> str:
    return ",".join(fields) + "\n"
