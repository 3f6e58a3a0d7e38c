from spans.ranges import chunks


def test_chunks_even():
    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_chunks_remainder():
    assert chunks([1, 2, 3], 2) == [[1, 2], [3]]
