from inventory.models import Item
from inventory.store import Store


def test_find_exact():
    store = Store()
    store.add(Item("AB-12", 3))
    assert store.find("AB-12").quantity == 3


def test_total_quantity():
    store = Store()
    store.add(Item("A", 2))
    store.add(Item("B", 5))
    assert store.total_quantity() == 7
