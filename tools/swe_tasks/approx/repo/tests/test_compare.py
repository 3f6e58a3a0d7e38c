from approx.compare import close_enough, sign


def test_equal_values():
    assert close_enough(1.5, 1.5)


def test_different_values():
    assert not close_enough(1.0, 1.1)


def test_sign():
    assert [sign(-2), sign(0), sign(3)] == [-1, 0, 1]
