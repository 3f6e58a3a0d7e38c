from inventory.models import Item


class Store:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        self.items[item.sku] = item

    def find(self, sku: str) -> Item | None:
        return self.items.get(sku)

    def total_quantity(self) -> int:
        return sum(item.quantity for item in self.items.values())
