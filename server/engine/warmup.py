"""Warm-up and calibration: what a started engine runs before it serves, so the first real request
pays no first-call costs and the step budget starts with fitted costs when there is a time target.

Both drive the engine through its `submit` alone, handed in with the few pieces they read (the
tokenizer, the budget, the block pool's size), so this module needs nothing of the engine itself."""

from __future__ import annotations

import queue
from typing import Protocol

from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.request import Sink
from server.engine.step_budget import StepBudget

EVENT_TIMEOUT_S = 600  # the longest wait for one event of a warm-up request


class Submit(Protocol):
    """The engine's `submit`, as far as warm-up uses it."""

    def __call__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        use_cache: bool = ...,
        cache_salt: str | None = ...,
    ) -> str: ...


def warm_up(submit: Submit, tokenizer: Tokenizer, context_length: int) -> None:
    """Runs a short request both ways (cached, then uncached), each to its end. Needs a started engine."""
    prompt = (tokenizer.encode("Hello") or [0])[: context_length - 2]
    for use_cache in (True, False):
        _wait(_submitted(submit, prompt, SamplingParams(max_new_tokens=2, temperature=0), use_cache, "warmup"))


def calibrate(
    submit: Submit,
    tokenizer: Tokenizer,
    context_length: int,
    budget: StepBudget,
    blocks: BlockManager,
    config: EngineConfig,
    requests: int = 8,
    new_tokens: int = 8,
) -> None:
    """Fits the step budget's costs on a burst of `requests` prompts of spread lengths (each up to the
    token cap): prompt-only, mixed and decode-only steps of several sizes. Needs a started engine."""
    budget.reset()
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog. ") or [0]
    requests = min(requests, config.max_num_seqs)
    room = blocks.num_blocks * blocks.block_size // requests - new_tokens - blocks.block_size
    longest = max(1, min(config.max_num_batched_tokens, context_length - new_tokens - 1, room))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    waits = []
    for i in range(requests):
        length = max(1, longest * (i + 1) // requests)
        waits.append(_submitted(submit, (text * (length // len(text) + 1))[:length], params, True, f"calibrate-{i}"))
    for events in waits:
        _wait(events)


def _submitted(
    submit: Submit, prompt_ids: list[int], params: SamplingParams, use_cache: bool, cache_salt: str
) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    submit(prompt_ids, params, events.put, use_cache=use_cache, cache_salt=cache_salt)
    return events


def _wait(events: queue.Queue) -> None:
    """Until the request's last event."""
    while not events.get(timeout=EVENT_TIMEOUT_S).finished:
        pass
