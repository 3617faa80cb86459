"""Warm-up and calibration: what a started engine runs before it serves, so the first real request
pays no first-call costs and the step budget starts with fitted costs when there is a time target."""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

from model.sampling import SamplingParams

if TYPE_CHECKING:
    from server.engine.engine import Engine


def warm_up(engine: Engine) -> None:
    """Runs a short request both ways (cached and uncached), then calibrates the step budget's costs
    when there is a time target. Needs a started engine."""
    prompt = engine.tokenizer.encode("Hello") or [0]
    for use_cache in (True, False):
        engine.generate(
            prompt[: engine.context_length - 2],
            SamplingParams(max_new_tokens=2, temperature=0),
            use_cache=use_cache,
            timeout=600,
            cache_salt="warmup",
        )
    if engine.budget.target_s is not None:
        calibrate(engine)


def calibrate(engine: Engine, requests: int = 8, new_tokens: int = 8) -> None:
    """Fits the step budget's costs on a burst of `requests` prompts of spread lengths (each up to the
    token cap): prompt-only, mixed and decode-only steps of several sizes. Needs a started engine."""
    engine.budget.reset()
    text = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") or [0]
    blocks, config = engine.blocks, engine.config
    requests = min(requests, config.max_num_seqs)
    room = blocks.num_blocks * blocks.block_size // requests - new_tokens - blocks.block_size
    longest = max(1, min(config.max_num_batched_tokens, engine.context_length - new_tokens - 1, room))
    waits = []
    for i in range(requests):
        length = max(1, longest * (i + 1) // requests)
        events: queue.Queue = queue.Queue()
        engine.submit(
            (text * (length // len(text) + 1))[:length],
            SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True),
            events.put,
            cache_salt=f"calibrate-{i}",
        )
        waits.append(events)
    for events in waits:
        while not events.get(timeout=600).finished:
            pass
