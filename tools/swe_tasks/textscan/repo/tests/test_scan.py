from textscan.scan import has_digit, words


def test_leading_digit():
    assert has_digit("7up")


def test_no_digit():
    assert not has_digit("hello")


def test_words():
    assert words("Hi, you 2!") == ["Hi", "you"]
