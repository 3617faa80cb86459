"""The sampler fills a step's grammar masks on its mask thread while the step's forward runs: `prepare` hands them
over and returns, the pick waits for them (server/engine/sampler.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from model.grammar import GrammarCompiler, GrammarSpec, allowed_tokens, bitmask_words
from model.sampling import SamplingParams
from server.engine.request import Request
from server.engine.sampler import Sampler

DIGITS = GrammarSpec("regex", "[0-9]{3}")


class FillsAfterTheForward:
    """A matcher whose mask waits until the test's forward has run: a sampler that filled masks before its forward
    would wait here in vain."""

    def __init__(self, inner, forward_ran: threading.Event) -> None:
        self.inner, self.forward_ran, self.saw_forward, self.thread = inner, forward_ran, None, None

    def fill(self, bitmask, row: int = 0) -> None:
        self.saw_forward = self.forward_ran.wait(timeout=10)
        self.thread = threading.current_thread()
        self.inner.fill(bitmask, row)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-pick", "torch-pick"])
def test_masks_are_filled_while_the_forward_runs_and_the_pick_waits_for_them(compiler, exact):
    V = compiler.vocab_size
    forward_ran = threading.Event()
    matcher = FillsAfterTheForward(compiler.matcher(DIGITS), forward_ran)
    params = SamplingParams(temperature=0.0, max_new_tokens=3, grammar=DIGITS)
    req = Request([1, 2, 3], params, seed=0, sink=lambda out: None, grammar=matcher)
    req.row = 0
    sampler = Sampler(max_rows=2, vocab_size=V, device=torch.device("cpu"), exact=exact)
    sampler.add_row(0, req)
    args = sampler.prepare([req])  # returns with the mask still to come
    forward_ran.set()  # the step's forward
    logits = torch.zeros(1, V)
    logits[0, 50] = 10.0  # the free pick: a token no three-digit string starts with
    (picked,) = sampler.sample(logits, args)
    assert matcher.saw_forward and matcher.thread is not threading.current_thread()
    assert picked.error is None and picked.token_id != 50
    mask = torch.zeros((1, bitmask_words(V)), dtype=torch.int32).numpy()
    compiler.matcher(DIGITS).fill(mask)
    assert allowed_tokens(mask, V)[0, picked.token_id]
    assert sampler.mask_stats.rows == 1
