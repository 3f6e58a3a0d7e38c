from grids import Grid


def test_set_get():
    g = Grid(3, 2)
    g.set(2, 1, "#")
    assert g.get(2, 1) == "#" and g.get(0, 0) == "."


def test_copy_has_same_cells():
    g = Grid(2, 2)
    g.set(1, 1, "#")
    assert g.copy().get(1, 1) == "#"
