import pytest

from retrying.retry import retry


def flaky(failures):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= failures:
            raise OSError("boom")
        return len(calls)

    return fn


def test_explicit_attempts():
    assert retry(flaky(2), attempts=3) == 3


def test_gives_up():
    with pytest.raises(OSError):
        retry(flaky(5), attempts=2)


def test_bad_attempts():
    with pytest.raises(ValueError):
        retry(flaky(0), attempts=0)
