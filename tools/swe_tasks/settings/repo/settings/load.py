import json


class SettingsError(Exception):
    pass


def load_settings(path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except Exception:
        return {}
