from csvtool.reader import read_line
from csvtool.writer import write_line


def test_plain_round_trip():
    assert read_line(write_line(["a", "b"])) == ["a", "b"]


def test_write_plain():
    assert write_line(["x", "y"]) == "x,y\n"
