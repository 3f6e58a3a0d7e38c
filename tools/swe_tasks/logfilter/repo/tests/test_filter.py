from logfilter.filter import filter_records
from logfilter.levels import level_number


def test_level_number():
    assert level_number("INFO") == 20


def test_keeps_warn_over_info():
    records = [{"level": "debug"}, {"level": "warn"}]
    assert filter_records(records, "info") == [{"level": "warn"}]
