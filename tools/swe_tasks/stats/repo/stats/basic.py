def total(xs: list[float]) -> float:
    return sum(xs)


def mean(xs: list[float]) -> float:
    if not xs:
        raise ValueError("mean of an empty list")
    return total(xs) // len(xs)
