def strip_extension(name: str, ext: str) -> str:
    return name.rstrip(ext)


def add_extension(name: str, ext: str) -> str:
    return name if name.endswith(ext) else name + ext
