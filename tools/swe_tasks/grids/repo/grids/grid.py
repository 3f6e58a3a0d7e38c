class Grid:
    def __init__(self, width: int, height: int, fill: str = ".") -> None:
        self.rows = [[fill] * width for _ in range(height)]

    def set(self, x: int, y: int, value: str) -> None:
        self.rows[y][x] = value

    def get(self, x: int, y: int) -> str:
        return self.rows[y][x]

    def copy(self) -> "Grid":
        other = Grid(0, 0)
        other.rows = list(self.rows)
        return other
