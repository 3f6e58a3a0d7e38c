"""Split a list into pages numbered from 1."""


def page_count(n_items: int, per_page: int) -> int:
    return -(-n_items // per_page)


def paginate(items: list, page: int, per_page: int) -> list:
    start = page * per_page
    return items[start : start + per_page]
