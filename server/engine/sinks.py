"""Where a request's events go. A sink is any callable taking one TokenOutput; the engine calls it on
its own thread, once per event, and a sink that raises means its consumer is gone.

`AsyncSink` feeds an asyncio queue. While the engine delivers a step (`LoopHandover.step()`) its events
are held per event loop and handed over in one `call_soon_threadsafe` per loop when the step's delivery
ends, whatever the number of requests and tokens.

With an interval (`--stream-interval-ms`), a loop is woken at most once per interval: a step's events
wait for a later step's while the loop was woken less than the interval ago, unless one of them is a
request's first event (its time to first token) or last (its end). Each wake-up costs the loop's thread
Python's lock, which the engine thread needs back when it returns from each native call; where steps are
shorter than the interval (a small model on a CPU) fewer wake-ups leave the engine more of it. A held
event waits at most the interval and one step: a step with prompt work (or an uncached request's
recompute), work run between steps, and an engine going idle hand everything over first. vLLM's and
SGLang's `--stream-interval` hold tokens likewise, counted in tokens.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from server.engine.request import TokenOutput

_active = threading.local()  # .handover: the LoopHandover whose step is being delivered on this thread


class AsyncSink:
    """One request's events into an asyncio queue owned by `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> None:
        self.loop, self.events = loop, events

    def __call__(self, out: TokenOutput) -> None:
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        urgent = out.finished or out.index <= 1  # a request's first or last event (one sink may serve several)
        handover = getattr(_active, "handover", None)
        if handover is None:  # outside a delivery: at once
            self.loop.call_soon_threadsafe(self.events.put_nowait, out)
        else:
            handover.hold(self.loop, self.events, out, urgent)


class LoopHandover:
    """The engine's events on their way to event loops: held during a step's delivery, then handed over
    in one wake-up per loop, or later (see the module's docstring). Used by the engine thread alone."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenOutput]]] = {}
        self._urgent: set[asyncio.AbstractEventLoop] = set()  # loops with an event that must go now
        self._woken_at: dict[asyncio.AbstractEventLoop, float] = {}  # monotonic time, within the interval

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @contextmanager
    def step(self) -> Iterator[None]:
        """AsyncSink events sent inside this block go to their loops at its end, or are held."""
        _active.handover = self
        try:
            yield
        finally:
            _active.handover = None
            self._hand_over(everything=self.interval_s <= 0)

    def hold(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, out: TokenOutput, urgent: bool) -> None:
        self._held.setdefault(loop, []).append((events, out))
        if urgent:
            self._urgent.add(loop)

    def flush(self) -> None:
        """Hands over everything held."""
        if self._held:
            self._hand_over(everything=True)

    def _hand_over(self, everything: bool) -> None:
        now = time.monotonic() if self.interval_s > 0 else 0.0  # no interval: no clock, nothing remembered
        for loop in list(self._held):
            recently = now - self._woken_at.get(loop, -math.inf) < self.interval_s
            if recently and not everything and loop not in self._urgent:
                continue
            items = self._held.pop(loop)
            if self.interval_s > 0:
                self._woken_at[loop] = now
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # a loop closed meanwhile: its consumers are gone, the next event to them raises
                pass
        self._urgent.clear()
        if self._woken_at:  # a loop woken longer ago is as one never woken
            self._woken_at = {loop: t for loop, t in self._woken_at.items() if now - t < self.interval_s}


def _put_all(items: list[tuple[asyncio.Queue, TokenOutput]]) -> None:
    for events, out in items:
        events.put_nowait(out)
