from clock.duration import format_duration, parse_duration


def test_format_two_digit_seconds():
    assert format_duration(130) == "2:10"


def test_parse():
    assert parse_duration("2:05") == 125
