class EventBus:
    handlers: list = []

    def subscribe(self, handler) -> None:
        self.handlers.append(handler)

    def emit(self, event: str) -> int:
        for handler in self.handlers:
            handler(event)
        return len(self.handlers)
