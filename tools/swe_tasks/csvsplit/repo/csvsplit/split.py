def split_fields(line: str, sep: str = ";") -> list[str]:
    """Split a comma-separated line (or another separator) and strip the fields."""
    return [field.strip() for field in line.split(sep)]
