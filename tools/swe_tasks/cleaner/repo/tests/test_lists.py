from cleaner.lists import dedupe, drop_negatives


def test_single_negative():
    assert drop_negatives([1, -2, 3]) == [1, 3]


def test_dedupe_keeps_order():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]
