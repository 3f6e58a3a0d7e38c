LEVELS = {"debug": 10, "info": 20, "warn": 30, "error": 40}


def level_number(name: str) -> int:
    return LEVELS[name.lower()]
