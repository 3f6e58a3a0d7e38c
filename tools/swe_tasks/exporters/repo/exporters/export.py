from exporters.formats import FORMATS


def export(rows: list[list[str]], fmt: str = "csv") -> str:
    """Render rows as csv or tsv."""
    return FORMATS[fmt](rows)
