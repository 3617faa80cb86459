"""Sampling: per-row parameters in one batch, draws from (seed, token index), top-k/top-p, the
repetition penalty, stop strings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.generate import generate
from model.sampling import (
    Penalties,
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    bias_rows,
    copy_seed,
    filter_top_k_top_p,
    pick_by_inverse_cdf,
    sample,
    top_logprobs,
    uniform_draws,
)
from model.text import StopMatcher

M64 = 2**64 - 1


def splitmix64_reference(seed: int, index: int) -> float:
    """The draw, written with Python's integers: what uniform_draws must compute."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def test_draws_are_splitmix64_of_seed_and_index_in_the_unit_interval():
    seeds, indices = [0, 1, 2**63 - 1, 12345, 2**64 - 1], [0, 7, 3, 10**6, 511]
    draws = uniform_draws(np.array(seeds, dtype=np.uint64), np.array(indices, dtype=np.uint64))
    assert draws.tolist() == [splitmix64_reference(s, i) for s, i in zip(seeds, indices)]
    assert ((0 <= draws) & (draws < 1)).all()


def test_the_copies_of_a_request_draw_from_streams_of_their_own():
    """n / best_of copies: no copy's draws are another's shifted by a few tokens (a copy's seed a plain step
    along the first's sequence of draws made copy c draw token i with the first copy's draw for token i + c)."""
    tokens = np.arange(64, dtype=np.uint64)
    for seed in range(100):
        streams = [uniform_draws(np.full(64, copy_seed(seed, c), dtype=np.uint64), tokens) for c in range(4)]
        assert copy_seed(seed, 0) == seed
        for a in range(4):
            for b in range(a + 1, 4):
                assert not set(streams[a].tolist()) & set(streams[b].tolist()), (seed, a, b)


def batch_of(params, seeds=None, indices=None, penalties=None):
    n = len(params)
    return SamplingBatch.from_params(params, seeds or list(range(n)), indices or [0] * n, "cpu", penalties)


def test_top_k_keeps_exactly_the_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = filter_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus_and_always_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = filter_top_k_top_p(probs.log(), torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_top_p_of_one_and_top_k_of_zero_keep_every_token():
    torch.manual_seed(0)
    logits = torch.randn(2, 50257) * 3  # peaked enough that a float32 cumsum reaches 1 before the tail
    out = filter_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert out.isfinite().all(), f"{(~out.isfinite()).sum().item()} tokens dropped with the filters off"


def test_repetition_penalty_lowers_seen_tokens_of_either_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[True, True, False]]), torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_presence_and_frequency_penalties_lower_a_logit_by_presence_plus_frequency_times_count():
    torch.manual_seed(3)
    logits = torch.randn(1, 12)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    history = [7, 2, 7, 7, 9]  # prompt: 7, 2; generated: 7, 7, 9 (only generated tokens count)
    penalties = Penalties.for_sequence(params, history, num_prompt=2, vocab_size=12)
    got = penalties.apply(logits)
    expected = logits.clone()
    for token, count in ((7, 2), (9, 1)):
        expected[0, token] -= 0.5 + 0.25 * count
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert torch.equal(got[0, [0, 1, 2, 3]], logits[0, [0, 1, 2, 3]]), "a token never generated is untouched"


def test_a_logit_bias_of_100_forces_its_token():
    torch.manual_seed(4)
    logits = torch.randn(2, 50)
    params = [
        SamplingParams(temperature=0, logit_bias=((13, 100.0),)),
        SamplingParams(temperature=0.8, seed=1, logit_bias=((31, 100.0), (13, -100.0))),
    ]
    penalties = Penalties(
        torch.ones(2),
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2, 50, dtype=torch.bool),
        torch.zeros(2, 50),
        bias_rows(params, 50, "cpu"),
    )
    tokens, logprobs = sample(logits, batch_of(params, penalties=penalties))
    assert tokens.tolist() == [13, 31]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])  # unbiased


def test_top_logprobs_are_the_k_best_of_the_unmodified_distribution():
    torch.manual_seed(5)
    logits = torch.randn(3, 40)
    ids, values = top_logprobs(logits, torch.logsumexp(logits, -1), 4)
    reference = logits.log_softmax(-1).topk(4, dim=-1)
    assert torch.equal(ids, reference.indices)
    torch.testing.assert_close(values, reference.values)


def test_inverse_cdf_picks_each_token_with_its_probability():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log()[None].expand(4000, -1)
    u = torch.from_numpy(uniform_draws(np.arange(4000, dtype=np.uint64), np.zeros(4000, dtype=np.uint64)))
    counts = torch.bincount(pick_by_inverse_cdf(logits, u), minlength=4).double() / 4000
    assert counts[1] == 0, "a token of probability 0 was picked"
    torch.testing.assert_close(counts, probs.double(), atol=0.03, rtol=0)  # ~4 standard deviations
    assert pick_by_inverse_cdf(probs.log()[None], torch.tensor([0.0], dtype=torch.float64)).item() == 0
    assert pick_by_inverse_cdf(probs.log()[None], torch.tensor([1 - 2**-53], dtype=torch.float64)).item() == 3


def test_rows_with_different_parameters_share_one_call():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=0.7, seed=5),
    ]
    tokens, logprobs = sample(logits, batch_of(params, seeds=[0, 1, 5]))
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()  # greedy, and top-k=1
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_a_seeded_row_samples_the_same_token_and_logprob_in_any_batch(rows):
    torch.manual_seed(1)
    logits = torch.randn(rows, 400) * 2
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=i) if i % 2 else SamplingParams(temperature=0)
        for i in range(rows)
    ]
    seeds, indices = list(range(rows)), [3 * i for i in range(rows)]
    tokens, logprobs = sample(logits, batch_of(params, seeds, indices))
    for i in range(rows):
        alone, alone_lp = sample(logits[i : i + 1], batch_of(params[i : i + 1], seeds[i : i + 1], indices[i : i + 1]))
        assert (alone.item(), alone_lp.item()) == (tokens[i].item(), logprobs[i].item()), f"row {i} of {rows}"


def test_same_seed_same_text_different_seed_different_text(tiny_model, tiny_tokenizer):
    def text(seed):
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        return [s.token_id for s in generate(tiny_model, tiny_tokenizer, "To be", params)]

    assert text(7) == text(7)
    assert text(7) != text(8)


def test_repetition_penalty_in_generate_changes_the_text(tiny_model, tiny_tokenizer):
    def ids(penalty):
        params = SamplingParams(max_new_tokens=40, temperature=0, repetition_penalty=penalty, ignore_eos=True)
        return [s.token_id for s in generate(tiny_model, tiny_tokenizer, "To be", params)]

    plain, penalised = ids(1.0), ids(3.0)
    assert plain != penalised
    assert len(set(penalised)) >= len(set(plain)), "a penalty for repeats should not narrow the vocabulary used"


def test_stop_string_spanning_pieces_is_found_and_never_leaks():
    matcher = StopMatcher(("END",))
    out = [matcher.push(p) for p in ["abc E", "N", "Dxyz"]]
    assert "".join(out) == "abc " and matcher.matched == "END"
    assert out[0] == "abc ", "the possible start of the stop string must be held back"


def test_held_back_text_is_released_when_it_is_not_a_stop():
    matcher = StopMatcher(("END",))
    assert matcher.push("xE") == "x"
    assert matcher.push("NX") == "ENX"
    assert matcher.flush() == "" and matcher.matched is None


def test_generation_stops_at_a_stop_string_with_reason_stop(tiny_model, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    full = "".join(s.text for s in generate(tiny_model, tiny_tokenizer, "To be", params))
    stop = full[10:13]
    assert len(stop) == 3
    steps = list(
        generate(tiny_model, tiny_tokenizer, "To be", params.__class__(**{**params.__dict__, "stop": (stop,)}))
    )
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_vanishing_temperature_and_top_p_do_not_break_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert SamplingParams(temperature=1e-9).greedy
    tokens, _ = sample(logits, batch_of([SamplingParams(temperature=1.0, top_p=1e-45, seed=0)]))
    assert tokens.tolist() == [1]
