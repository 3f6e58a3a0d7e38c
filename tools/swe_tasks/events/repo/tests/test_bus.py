from events.bus import EventBus
from events.recorder import Recorder


def test_emit_reaches_handler():
    bus = EventBus()
    rec = Recorder()
    bus.subscribe(rec)
    bus.emit("x")
    assert "x" in rec.seen


def test_emit_counts_handlers():
    assert EventBus().emit("y") >= 0
