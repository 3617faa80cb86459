"""How many prompt tokens a step may carry so that it stays under a time target (`--target-step-ms`).

A step's time is modelled as linear in what it computes (`StepWork`):

    seconds = fixed + per_decode_row * decode rows + per_context * decode context + per_prompt_token * prompt tokens

The costs are fitted by least squares over the most recent steps (a window), each refit pulled
toward the previous one, so a kind of work the window lacks keeps its last cost. The first fit
comes from the engine's warm-up (`warmup.calibrate`); every step then corrects it. Before any fit,
and with no target, a step carries what `max_num_batched_tokens` leaves after its decode rows,
which stays a hard cap either way. Sarathi-Serve sizes its chunks to a time-between-tokens SLO in
the same spirit; this is our own formulation.

The time target only binds steps that carry decode rows: a step with none delays no stream, so it
takes up to the hard cap of prompt tokens.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_PROMPT_TOKENS = 16  # prompt tokens a step may always carry, whatever its decode rows cost: prompts progress
CONTEXT_UNIT = 1024  # decode context is counted in units of this many tokens, to keep the fit well scaled
WINDOW = 256  # recent steps the fit uses
REFIT_EVERY = 16  # steps between two fits, once the first WINDOW // 8 steps are in
# Typical magnitude of each feature, so that one ridge weight suits them all.
FEATURE_SCALE = np.array([1.0, 32.0, 8.0, 128.0])
RIDGE = 0.01  # weight of the previous fit, in scaled pseudo-observations: keeps a direction the window lacks


@dataclass(frozen=True)
class StepWork:
    """What one step computes, as the cost model sees it."""

    decode_rows: int  # requests that compute one new token from their cache (each samples)
    decode_context: int  # sum of those rows' sequence lengths: keys and values read by their attention
    prompt_tokens: int  # every other token: prompt chunks and uncached recomputes

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decode_rows, self.decode_context / CONTEXT_UNIT, self.prompt_tokens])


@dataclass(frozen=True)
class StepCosts:
    """A fitted cost model, in seconds."""

    fixed: float  # per step, whatever it carries
    per_decode_row: float
    per_context_unit: float  # per CONTEXT_UNIT tokens of decode context
    per_prompt_token: float

    def seconds(self, work: StepWork) -> float:
        return float(self.vector() @ work.features())

    def vector(self) -> np.ndarray:
        return np.array([self.fixed, self.per_decode_row, self.per_context_unit, self.per_prompt_token])


class StepCostModel:
    """Least squares over a window of (work, seconds), ridge-pulled toward the previous fit."""

    def __init__(self, window: int = WINDOW, refit_every: int = REFIT_EVERY) -> None:
        self._samples: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self.costs: StepCosts | None = None  # None until the first fit
        self.num_observed = 0

    def observe(self, work: StepWork, seconds: float) -> None:
        self._samples.append((work.features() / FEATURE_SCALE, seconds))
        self.num_observed += 1
        self._since_fit += 1
        warming = len(self._samples) < self._samples.maxlen // 8
        if warming or self._since_fit >= self._refit_every:
            self.fit()

    def fit(self) -> None:
        """Refits now from the window (needs two different kinds of step to say anything)."""
        self._since_fit = 0
        if len(self._samples) < 2:
            return
        x = np.stack([s[0] for s in self._samples])  # (W, 4)
        y = np.array([s[1] for s in self._samples])  # (W,)
        previous = self.costs.vector() * FEATURE_SCALE if self.costs else np.zeros(4)
        if self.costs is None:  # no prior yet: the fixed part starts at the fastest step
            previous[0] = float(y.min())
        a = x.T @ x + RIDGE * np.eye(4)  # (4, 4)
        b = x.T @ y + RIDGE * previous  # (4,)
        theta = np.linalg.solve(a, b) / FEATURE_SCALE  # (4,)
        theta = np.maximum(theta, 0.0)  # no work makes a step faster
        self.costs = StepCosts(*map(float, theta))


class StepBudget:
    """The prompt tokens the next step may carry, from the target and the fitted costs. Thread-safe:
    the engine thread observes and asks; a scrape reads `target_s` and `last_allowance`."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        min_prompt_tokens: int = MIN_PROMPT_TOKENS,
        target_s: float | None = None,
        model: StepCostModel | None = None,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens  # the hard cap, decode rows included
        self.min_prompt_tokens = min_prompt_tokens  # what prompts always get, so that they progress
        self.target_s = target_s  # None: no time target, the token cap alone
        self.model = model or StepCostModel()
        self.last_allowance = max_num_batched_tokens  # the prompt tokens the latest step was allowed
        self._lock = threading.Lock()

    def prompt_tokens(self, decode_rows: int, decode_context: int) -> int:
        """Prompt tokens the next step may carry beside `decode_rows` rows reading `decode_context` tokens."""
        capped = max(self.max_num_batched_tokens - decode_rows, self.min_prompt_tokens)
        with self._lock:
            costs = self.model.costs
        if self.target_s is None or costs is None or decode_rows == 0:
            allowance = capped
        else:
            spent = costs.seconds(StepWork(decode_rows, decode_context, 0))
            room = self.target_s - spent
            fits = int(room / costs.per_prompt_token + 1e-6) if costs.per_prompt_token > 0 else capped
            allowance = min(max(fits, self.min_prompt_tokens), capped)
        self.last_allowance = allowance
        return allowance

    def reset(self) -> None:
        """Forgets every step seen so far (the engine calibrates after its first-call costs are paid)."""
        with self._lock:
            self.model = StepCostModel()

    def observe(self, work: StepWork, seconds: float) -> None:
        """A step's measured time, to correct the costs (kept only when there is a target to serve)."""
        if self.target_s is None:
            return
        with self._lock:
            self.model.observe(work, seconds)

    @property
    def costs(self) -> StepCosts | None:
        with self._lock:
            return self.model.costs
