import pytest

from bounds.clamp import clamp, in_range


def test_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 5, 0)


def test_in_range():
    assert in_range(5, 0, 10) and not in_range(11, 0, 10)
