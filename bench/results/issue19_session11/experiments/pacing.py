"""How a replica's stream gathers its requests' events into items (`--stream-interval-ms`).

Each item crossing Ray costs the replica's event loop a fixed amount of work (Serve's stream, its
serialization, gRPC), and that loop shares Python's lock with the engine thread. An item therefore
carries everything queued since the last one, and with an interval no item leaves sooner than that after
the previous one, unless it carries a request's first event (its time to first token) or its last (the
request's end), or the stream is closing. Steps slower than the interval are never held: each goes at
once, as without one. vLLM's and SGLang's `--stream-interval` do the same in tokens; this one is in time,
so that it only gathers where steps are fast enough for the per-item cost to matter.
"""
from __future__ import annotations

import asyncio
import math

from server.engine import TokenOutput


class PacedQueue(asyncio.Queue):
    """A stream's events (None: woken to close), read an item at a time with `gather`."""

    def __init__(self, interval_s: float = 0.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._seen: set[str] = set()  # requests with an event queued, and no last event yet
        self._urgent = False  # a queued event must leave at once
        self._last_item_at = -math.inf  # loop time of the last item
        self._nap: asyncio.Future | None = None  # while `gather` waits out the interval

    def put_nowait(self, out: TokenOutput | None) -> None:
        super().put_nowait(out)
        if out is None or out.finished:
            if out is not None:
                self._seen.discard(out.request_id)
        elif out.request_id in self._seen:
            return
        else:
            self._seen.add(out.request_id)
        self._urgent = True
        if self._nap is not None and not self._nap.done():
            self._nap.set_result(None)

    def forget(self, request_ids) -> None:
        """These requests will have no more events here (a call that ended without their last one)."""
        self._seen.difference_update(request_ids)

    async def gather(self, first: TokenOutput | None) -> list[TokenOutput | None]:
        """`first` (just got), then what else is queued, once the interval since the last item has passed
        or an event that must leave at once is queued."""
        loop = asyncio.get_running_loop()
        wait = self._last_item_at + self.interval_s - loop.time()
        if wait > 0 and not self._urgent:
            self._nap = loop.create_future()
            timer = loop.call_later(wait, _wake, self._nap)
            try:
                await self._nap
            finally:
                timer.cancel()
                self._nap = None
        batch = [first]
        while not self.empty():
            batch.append(self.get_nowait())
        self._urgent = False
        self._last_item_at = loop.time()
        return batch


def _wake(nap: asyncio.Future) -> None:
    if not nap.done():
        nap.set_result(None)
