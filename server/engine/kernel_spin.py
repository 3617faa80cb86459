"""Whether the kernels' idle threads spin between a step's kernel calls, decided step by step.

A worker of the kernels' thread pool that runs out of tasks spins (`configured_spin_us`, 100 µs)
before it sleeps, so that the step's next kernel call finds it awake. That pays wherever a step
batches several sequences or is long: it spares a wake-up per kernel call. It does not pay for one
sequence alone in short steps (the default checkpoint at concurrency 1, about a millisecond a step):
there the spinning thread holds the core that the event loop needs to hand the previous token to
its stream, and that a client on the same machine needs to read it, and now and then a token waits
for a whole further step. So a step of one sequence, while the recent steps are shorter than
`SHORT_STEP_S`, runs with idle threads that sleep at once (BENCHMARKS.md, "Latency under load", measures both).
"""

from __future__ import annotations

from model import kernels

SHORT_STEP_S = 0.005  # a lone sequence's steps shorter than this (recent average) run without the spin
SMOOTHING = 0.25  # weight of the latest step in the recent average


class KernelSpin:
    """Sets the kernels' idle spin for the next step from the steps so far; the engine thread calls
    `observe` after each step. Process-wide, as the kernels' thread pool is."""

    def __init__(self, long_step_spin_us: int | None = None, short_step_s: float = SHORT_STEP_S) -> None:
        self.spin_us = kernels.configured_spin_us() if long_step_spin_us is None else long_step_spin_us
        self.short_step_s = short_step_s
        self.recent_s: float | None = None  # smoothed step time; None before the first step
        self.current_us: int | None = None  # what was last set; None: not set by us yet

    def observe(self, seconds: float, sequences: int) -> None:
        """A step of `sequences` sequences took `seconds`: the next one spins unless it is a lone short one."""
        self.recent_s = seconds if self.recent_s is None else self.recent_s + SMOOTHING * (seconds - self.recent_s)
        spin = 0 if sequences == 1 and self.recent_s < self.short_step_s else self.spin_us
        if spin != self.current_us:
            kernels.set_spin_us(spin)
            self.current_us = spin
