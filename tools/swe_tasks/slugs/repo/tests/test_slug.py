from slugs.slug import slugify


def test_simple():
    assert slugify("Hello World") == "hello-world"


def test_digits_kept():
    assert slugify("Top 10") == "top-10"
