def make_item(name: str, tags: list[str] = []) -> dict:
    return {"name": name, "tags": tags}


def add_tag(item: dict, tag: str) -> dict:
    if tag not in item["tags"]:
        item["tags"].append(tag)
    return item
