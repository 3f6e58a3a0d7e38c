from exporters import export


def test_csv():
    assert export([["a", "b"], ["c", "d"]]) == "a,b\nc,d\n"
