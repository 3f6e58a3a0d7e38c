def inclusive_range(a: int, b: int) -> list[int]:
    """Integers from a to b, both included."""
    return list(range(a, b))


def chunks(seq: list, size: int) -> list[list]:
    """Consecutive pieces of at most `size` items."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]
