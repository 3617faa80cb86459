"""Sampling: per-row parameters in one batch, seeds, top-k/top-p, repetition penalty, stop strings."""
from __future__ import annotations

import torch

from model.generate import generate
from model.sampling import SamplingParams, StopMatcher, apply_repetition_penalty, filter_top_k_top_p, sample


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
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_rows_with_different_parameters_share_one_call():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1, seed=1),
              SamplingParams(temperature=0.7, seed=5)]
    gens = [p.make_generator() for p in params]
    tokens, logprobs = sample(logits, params, gens)
    assert tokens[0] == logits[0].argmax() and tokens[1] == logits[1].argmax()  # greedy, and top-k=1
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0])
    again, _ = sample(logits[2:], params[2:], [params[2].make_generator()])
    assert again[0] == tokens[2], "a seeded row must not depend on the other rows of the batch"


def test_same_seed_same_text_different_seed_different_text(tiny_model, tiny_tokenizer):
    def text(seed):
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        return [s.token_id for s in generate(tiny_model, tiny_tokenizer, "To be", params)]
    assert text(7) == text(7)
    assert text(7) != text(8)


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
    steps = list(generate(tiny_model, tiny_tokenizer, "To be", params.__class__(**{**params.__dict__, "stop": (stop,)})))
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_vanishing_temperature_and_top_p_do_not_break_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert SamplingParams(temperature=1e-9).greedy
    params = [SamplingParams(temperature=1.0, top_p=1e-45, seed=0)]
    tokens, _ = sample(logits, params, [params[0].make_generator()])
    assert tokens.tolist() == [1]
