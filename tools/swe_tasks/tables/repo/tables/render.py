def render_table(rows: list[list[str]]) -> str:
    widths = [len(cell) for cell in rows[0]]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)
