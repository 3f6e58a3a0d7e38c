def to_cents(amount: float) -> int:
    return int(amount * 100)


def from_cents(cents: int) -> float:
    return cents / 100
