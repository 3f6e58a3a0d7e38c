from shop.money import from_cents


class Cart:
    def __init__(self) -> None:
        self.prices: list[float] = []

    def add(self, price: float) -> None:
        self.prices.append(price)

    def total_cents(self) -> int:
        return sum(int(p * 100) for p in self.prices)

    def total(self) -> float:
        return from_cents(self.total_cents())
