def percent_done(done: int, total: int) -> float:
    return done * 100 // total


def bar(fraction: float, width: int = 10) -> str:
    filled = round(fraction * width)
    return "#" * filled + "-" * (width - filled)
