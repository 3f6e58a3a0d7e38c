def format_price(cents: int) -> str:
    return f"${cents / 100}"


def format_percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"
