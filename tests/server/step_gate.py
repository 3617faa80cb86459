"""Holding the engine between two steps, with its thread still serving `run_between_steps` (so `GET /kv`
answers while a request is held mid-generation; `engine_held_after_token` holds inside a step instead)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from server.engine import Engine
from server.engine.scheduler import Scheduler, SchedulerOutput

HOLD_POLL_S = 0.005  # how often a held engine looks again (it idles between looks)


class StepGate:
    """While `hold(scheduler)` is true, every step schedules nothing, so the block pool stays as it is
    (pending cancellations and waiting requests wait too); a new condition, or None, lets it go on."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held = threading.Event()  # set when a step found the gate shut under the current condition
        self._hold: Callable[[Scheduler], bool] | None = None
        self._lock = threading.Lock()  # a new condition and a step's look at it never cross
        self._schedule = engine.scheduler.schedule

    def hold_when(self, hold: Callable[[Scheduler], bool] | None) -> None:
        with self._lock:
            self.held.clear()
            self._hold = hold

    @property
    def at(self) -> None:
        raise AttributeError("write-only: gate.at = n holds once a running request has n generated tokens")

    @at.setter
    def at(self, num_tokens: int | None) -> None:
        """Holds once a running request has `num_tokens` generated tokens (None: open)."""
        self.hold_when(
            None if num_tokens is None else lambda s: any(r.num_output_tokens >= num_tokens for r in s.running)
        )

    def _gated_schedule(self) -> SchedulerOutput:
        with self._lock:
            shut = self._hold is not None and self._hold(self.engine.scheduler)
            if shut:
                self.held.set()
        if shut:
            threading.Event().wait(HOLD_POLL_S)
            return SchedulerOutput()
        return self._schedule()

    def wait_held(self, what: str, timeout: float = 60.0) -> None:
        assert self.held.wait(timeout), f"the engine never reached {what}"


@contextmanager
def step_gate(engine: Engine) -> Iterator[StepGate]:
    gate = StepGate(engine)
    engine.scheduler.schedule = gate._gated_schedule
    try:
        yield gate
    finally:
        del engine.scheduler.schedule
