from counters.merge import merge_counts


def test_merge_values():
    assert merge_counts({"x": 1}, {"x": 2, "y": 3}) == {"x": 3, "y": 3}


def test_merge_empty():
    assert merge_counts({}, {"y": 1}) == {"y": 1}
