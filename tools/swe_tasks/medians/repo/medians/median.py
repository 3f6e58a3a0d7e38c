def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def spread(values: list[float]) -> float:
    return max(values) - min(values)
