def is_leap_year(year: int) -> bool:
    return year % 4 == 0 and year % 100 != 0


def days_in_year(year: int) -> int:
    return 366 if is_leap_year(year) else 365
