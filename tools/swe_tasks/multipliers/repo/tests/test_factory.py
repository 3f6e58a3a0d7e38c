from multipliers.factory import make_adder, make_multipliers


def test_count():
    assert len(make_multipliers(4)) == 4


def test_adder():
    assert make_adder(3)(4) == 7
