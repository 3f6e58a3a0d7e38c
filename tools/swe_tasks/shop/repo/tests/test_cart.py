from shop.cart import Cart
from shop.money import from_cents, to_cents


def test_round_prices():
    cart = Cart()
    cart.add(1.5)
    cart.add(2.0)
    assert cart.total_cents() == 350


def test_from_cents():
    assert from_cents(250) == 2.5


def test_to_cents_exact():
    assert to_cents(2.5) == 250
