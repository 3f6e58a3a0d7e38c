def to_csv(rows: list[list[str]]) -> str:
    return "".join(",".join(row) + "\n" for row in rows)


FORMATS = {"csv": to_csv}
