from moneyfmt.fmt import format_percent, format_price


def test_price_with_cents():
    assert format_price(1234) == "$12.34"


def test_percent():
    assert format_percent(0.25) == "25%"
