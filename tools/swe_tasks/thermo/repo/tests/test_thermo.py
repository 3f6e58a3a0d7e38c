from thermo.convert import celsius_to_fahrenheit, fahrenheit_to_celsius


def test_freezing():
    assert fahrenheit_to_celsius(32) == 0


def test_back_to_fahrenheit():
    assert celsius_to_fahrenheit(100) == 212
