def fahrenheit_to_celsius(f: float) -> float:
    return (f - 32) * 5 // 9


def celsius_to_fahrenheit(c: float) -> float:
    return c * 9 / 5 + 32
