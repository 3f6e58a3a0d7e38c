def filter_records(records: list[dict], threshold: str) -> list[dict]:
    """Records whose level is at least `threshold`."""
    return [r for r in records if r["level"] >= threshold]
