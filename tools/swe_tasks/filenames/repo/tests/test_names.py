from filenames.names import add_extension, strip_extension


def test_strip_simple():
    assert strip_extension("notes.txt", ".txt") == "notes"


def test_add_extension():
    assert add_extension("notes", ".txt") == "notes.txt"
    assert add_extension("notes.txt", ".txt") == "notes.txt"
