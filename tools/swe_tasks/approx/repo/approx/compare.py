def close_enough(a: float, b: float) -> bool:
    return a == b


def sign(x: float) -> int:
    return (x > 0) - (x < 0)
