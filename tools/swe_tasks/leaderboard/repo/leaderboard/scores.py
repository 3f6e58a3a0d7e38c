def best(scores: list[int]) -> int:
    return max(scores)


def ranking(scores: list[int]) -> list[int]:
    return scores.sort(reverse=True)
