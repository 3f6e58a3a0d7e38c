def clamp(x: float, lo: float, hi: float) -> float:
    if lo > hi:
        raise ValueError("lo must not exceed hi")
    return max(hi, min(lo, x))


def in_range(x: float, lo: float, hi: float) -> bool:
    return lo <= x <= hi
