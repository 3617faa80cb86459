"""Whether a request can ever be admitted, and in what order prompts get a step's prompt tokens.

A prompt is refused at submission (`check_fits`) when it does not fit the context or, with the
copies that share its blocks, the whole KV cache: such a request would wait for ever.

Order: shortest remaining prompt first, with ageing.

Giving the tokens to the prompt closest to done gets first tokens out soonest (the mean time to
first token is lowest when the shortest job goes first). Alone it starves a long prompt behind a
stream of short ones, so a request that has waited AGEING_S since it arrived, or that was preempted,
is *aged*: aged requests go before all others, oldest first, and a waiting aged request that does
not fit (blocks, running places) stops admission until it does. Since every running request ends
(max_new_tokens, the context), places and blocks come free, and prompts always get
`min_prompt_tokens` a step, no request waits without bound.
"""

from __future__ import annotations

import time

from model.config import ContextLengthError, check_prompt
from server.engine.block_manager import BlockManager
from server.engine.request import Request

AGEING_S = 1.0  # seconds since arrival after which a prompt goes first, whatever its length


def check_fits(
    prompt_ids: list[int], max_new_tokens: int, blocks: BlockManager, context: int, vocab_size: int, copies: int = 1
) -> None:
    """Raises PromptError unless the prompt fits the context and, with `copies` requests sharing its
    blocks (each generating up to `max_new_tokens`), the KV cache (ContextLengthError: the KV cache is this
    server's context, and a shorter prompt or fewer tokens would fit)."""
    check_prompt(prompt_ids, max_new_tokens, context, vocab_size)
    prompt_blocks = blocks.blocks_for(len(prompt_ids))
    own = blocks.blocks_for(len(prompt_ids) + max_new_tokens) - prompt_blocks + 1  # + the last one
    needed = prompt_blocks + copies * own - (1 if copies else 0)
    if needed > blocks.num_blocks:
        many = f"{copies} copies of " if copies > 1 else ""
        raise ContextLengthError(
            f"{many}prompt + max_new_tokens need {needed} KV-cache blocks; the cache has "
            f"{blocks.num_blocks} (--kv-cache-memory)"
        )


def is_aged(req: Request, now: float) -> bool:
    return req.stats.preemptions > 0 or now - req.stats.arrival >= AGEING_S


def prompt_order(requests: list[Request], now: float | None = None) -> list[Request]:
    """`requests` (still reading their prompt, running or waiting) in the order they get prompt tokens:
    aged ones first by arrival, then the others by remaining tokens, ties by arrival."""
    now = time.perf_counter() if now is None else now

    def key(req: Request) -> tuple[bool, int, float]:
        if is_aged(req, now):
            return False, 0, req.stats.arrival
        return True, req.num_tokens - req.num_computed, req.stats.arrival

    return sorted(requests, key=key)
