from leaderboard.scores import best


def test_best():
    assert best([3, 9, 2]) == 9
