def to_int(value, default=None):
    try:
        return int(value)
    except ValueError:
        return default


def to_float(value, default=None):
    try:
        return float(value)
    except (TypeError, ValueError):
        return default
