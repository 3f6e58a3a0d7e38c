from lookup.paths import get_path


def test_nested():
    assert get_path({"a": {"b": 1}}, "a.b") == 1


def test_missing_top_level():
    assert get_path({}, "a.b", default=7) == 7
