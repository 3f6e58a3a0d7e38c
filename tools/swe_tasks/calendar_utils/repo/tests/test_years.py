from calendar_utils.years import days_in_year, is_leap_year


def test_common_leap_year():
    assert is_leap_year(2024)


def test_century_not_leap():
    assert not is_leap_year(1900)


def test_days_in_year():
    assert days_in_year(2023) == 365
