from convert.numbers import to_float, to_int


def test_to_int():
    assert to_int("12") == 12


def test_to_int_bad_text():
    assert to_int("x", default=0) == 0


def test_to_float_none():
    assert to_float(None, default=1.5) == 1.5
