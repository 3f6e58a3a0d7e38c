from medians.median import median, spread


def test_odd():
    assert median([5, 1, 3]) == 3


def test_spread():
    assert spread([4, 1, 9]) == 8
