def get_path(data: dict, path: str, default=None):
    """data["a"]["b"] for path "a.b"; default when a key is missing."""
    first, *rest = path.split(".")
    if first not in data:
        return default
    value = data[first]
    for key in rest:
        value = value[key]
    return value
