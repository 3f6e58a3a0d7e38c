from tables.render import render_table


def test_header_widest():
    assert render_table([["name", "qty"], ["a", "1"]]) == "name | qty\na    | 1"


def test_single_row():
    assert render_table([["x", "y"]]) == "x | y"
