from csvsplit.split import split_fields


def test_explicit_separator():
    assert split_fields("a| b |c", sep="|") == ["a", "b", "c"]


def test_strips_fields():
    assert split_fields(" a ; b", sep=";") == ["a", "b"]
