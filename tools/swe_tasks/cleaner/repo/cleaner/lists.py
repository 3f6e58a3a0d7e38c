def drop_negatives(values: list[int]) -> list[int]:
    for v in values:
        if v < 0:
            values.remove(v)
    return values


def dedupe(values: list[int]) -> list[int]:
    return list(dict.fromkeys(values))
