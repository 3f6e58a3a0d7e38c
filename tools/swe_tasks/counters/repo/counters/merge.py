def merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    result = a
    for key, n in b.items():
        result[key] = result.get(key, 0) + n
    return result
