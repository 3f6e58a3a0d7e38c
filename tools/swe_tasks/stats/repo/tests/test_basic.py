import pytest

from stats import mean, total


def test_total():
    assert total([1, 2, 3]) == 6


def test_mean_even():
    assert mean([2, 4]) == 3


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])
