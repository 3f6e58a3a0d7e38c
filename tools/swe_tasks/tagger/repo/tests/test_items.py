from tagger.items import add_tag, make_item


def test_explicit_tags():
    item = make_item("x", ["red"])
    assert add_tag(item, "blue")["tags"] == ["red", "blue"]


def test_no_duplicate_tags():
    item = make_item("x", ["red"])
    assert add_tag(item, "red")["tags"] == ["red"]
