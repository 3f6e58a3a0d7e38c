from progress.bar import bar, percent_done


def test_half():
    assert percent_done(5, 10) == 50


def test_bar():
    assert bar(0.5, 4) == "##--"
