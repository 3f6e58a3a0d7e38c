class Recorder:
    seen: list = []

    def __call__(self, event: str) -> None:
        self.seen.append(event)
