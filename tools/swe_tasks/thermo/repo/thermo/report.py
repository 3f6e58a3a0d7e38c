from thermo.convert import fahrenheit_to_celsius


def report(f: float) -> str:
    return f"{f} °F = {fahrenheit_to_celsius(f):.0f} °C"
