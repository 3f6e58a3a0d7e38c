from pager import page_count


def test_page_count_rounds_up():
    assert page_count(25, 10) == 3


def test_page_count_exact():
    assert page_count(20, 10) == 2
