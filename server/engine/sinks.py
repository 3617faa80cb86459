"""Where a request's events go. A sink is any callable taking one TokenOutput; the engine calls it on
its own thread, once per event, and a sink that raises means its consumer is gone.

`AsyncSink` feeds an asyncio queue. Inside `one_wakeup_per_loop()` (the engine's delivery of one step)
its events are held per event loop and handed over in one `call_soon_threadsafe` per loop when the
block ends, whatever the number of requests and tokens.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from server.engine.request import TokenOutput

_held = threading.local()  # .batches: {loop: [(queue, event)]} while a delivery is open on this thread


class AsyncSink:
    """One request's events into an asyncio queue owned by `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self.loop, self.events = loop, events

    def __call__(self, out: TokenOutput) -> None:
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        batches = getattr(_held, "batches", None)
        if batches is None:  # outside a delivery: at once
            self.loop.call_soon_threadsafe(self.events.put_nowait, out)
        else:
            batches.setdefault(self.loop, []).append((self.events, out))


@contextmanager
def one_wakeup_per_loop() -> Iterator[None]:
    """AsyncSink events sent inside this block reach each event loop in one wake-up at its end. A loop
    closed meanwhile drops its events (its consumers are gone; the next event to them raises)."""
    _held.batches = {}
    try:
        yield
    finally:
        batches, _held.batches = _held.batches, None
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[asyncio.Queue, TokenOutput]]) -> None:
    for events, out in items:
        events.put_nowait(out)
