"""The n-gram drafter alone: its index finds what a brute-force search finds, and its drafts follow
their measured worth (no draft where lookups do not come true, full drafts where they do)."""

from __future__ import annotations

import random

import pytest

from model.sampling import SamplingParams
from server.engine.ngram_history import NgramHistory
from server.engine.request import Request
from server.engine.speculative import Drafter, DraftState, accepted_length, break_even_rate, draft_length


def latest_earlier_match(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """Brute force: the end of the latest earlier occurrence of the longest suffix n-gram."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return end
    return None


@pytest.mark.parametrize("vocab", [3, 12, 70000])
def test_the_incremental_index_finds_the_latest_occurrence_of_the_longest_suffix(vocab):
    rng = random.Random(vocab)
    drafter, state, tokens = Drafter(4, 2, 4), DraftState(), []
    while len(tokens) < 400:
        tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]  # steps gain 1 or more tokens
        drafter._extend(state, tokens)
        assert state.match == latest_earlier_match(tokens, 2, 4), f"at length {len(tokens)}"


def test_draft_length_keeps_the_tokens_whose_acceptance_chance_beats_the_break_even():
    assert draft_length(0.73, 0.125, 8) == 6  # 0.73 ** 6 = 0.151, 0.73 ** 7 = 0.110
    assert draft_length(0.73, 0.125, 4) == 4
    assert draft_length(0.7, 0.42, 8) == 2  # 0.49 pays, 0.343 does not
    assert draft_length(0.4, 0.42, 8) == 0
    assert draft_length(1.0, 0.58, 5) == 5
    assert 0.1 < break_even_rate(1) < break_even_rate(8) < break_even_rate(32) < 1


def run(drafter: Drafter, req: Request, text: list[int]) -> list[list[int]]:
    """Steps the request through `text`, as the engine would: each step verifies its draft against the
    text (the target's own tokens), records it and gains the accepted tokens plus one (counting the
    accepted ones in the request's stats, as the engine does as it appends them). Returns the drafts."""
    drafts, at = [], 0
    while at < len(text):
        req.num_computed = req.num_tokens - 1
        drafter.draft_all([req])
        draft = req.draft[: len(text) - at - 1]
        drafts.append(draft)
        accepted = accepted_length(draft, text[at:])
        if draft:
            drafter.record(req, len(draft), accepted)
        req.token_ids += text[at : at + accepted + 1]
        req.stats.accepted_draft_tokens += accepted
        at += accepted + 1
    return drafts


def request(prompt: list[int]) -> Request:
    return Request(prompt, SamplingParams(max_new_tokens=1000, temperature=0), 0, lambda e: None)


def test_a_request_whose_lookups_never_come_true_never_drafts():
    """'1 2 x' with a new x each time: after '1 2' the lookup proposes the previous x, always wrong."""
    drafter, req = Drafter(4, 2, 4), request([1, 2, 100])
    drafts = run(drafter, req, [t for i in range(200) for t in (1, 2, 101 + i)])
    assert not any(drafts), "it drafted although no lookup ever came true"
    assert req.draft_state.acceptance < 0.01


def test_a_request_whose_lookups_come_true_drafts_k_tokens_after_a_few_shadow_hits():
    drafter, req = Drafter(4, 2, 4), request([5, 6, 7, 8, 9])
    drafts = run(drafter, req, [5, 6, 7, 8, 9] * 8)
    assert drafts[0] == [] and all(len(d) == 4 for d in drafts[-4:-1]), drafts
    first = next(i for i, d in enumerate(drafts) if d)
    assert first <= 4, f"it took {first} steps of correct lookups to start drafting"
    assert req.stats.accepted_draft_tokens == req.stats.draft_tokens > 20
    before = req.stats.draft_tokens
    drafts = run(drafter, req, [t for i in range(30) for t in (5, 6, 200 + i)])  # then its lookups fail
    rejected = req.stats.draft_tokens - req.stats.accepted_draft_tokens
    assert 0 < rejected <= 24 and not any(drafts[-60:]), (rejected, drafts)
    assert req.stats.draft_tokens - before < 30


def test_the_history_gives_what_followed_the_last_n_tokens_and_chains_through_its_own_draft():
    history = NgramHistory(3, 1000)
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    assert history.learn(None, text, 0) == 7  # the last token's follower is not known yet
    assert history.follow(None, [9, 1, 2, 3], 4) == [4, 5, 6, 7]  # 2 3 4 -> 5, 3 4 5 -> 6, ...
    assert history.follow(None, [9, 6, 7, 8], 4) == []  # 6 7 8 was never followed
    assert history.follow(None, [2, 3], 4) == []  # shorter than n
    history.learn(None, [5, 6, 7, 42], 0)  # a later write wins
    assert history.follow(None, [5, 6, 7], 1) == [42]


def test_the_history_keeps_salts_apart_and_stays_bounded():
    history = NgramHistory(2, 100)
    history.learn("tenant-a", [1, 2, 3], 0)
    assert history.follow("tenant-a", [1, 2], 1) == [3]
    assert history.follow("tenant-b", [1, 2], 1) == [] and history.follow(None, [1, 2], 1) == []
    for i in range(50):
        history.learn(None, [1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i, 7], 0)
        assert len(history) <= 100
    assert history.follow(None, [1000 + 3 * 49, 1001 + 3 * 49], 1) == [1002 + 3 * 49]  # the newest stay
    assert history.follow("tenant-a", [1, 2], 1) == []  # the oldest went first


def test_a_request_drafts_what_an_earlier_request_produced_from_the_shared_history():
    """The second request's text, never seen in its own tokens, comes from the first's: it drafts
    from the first step on (after the shadow drafts that raise its estimate), and accepts them."""
    text = random.Random(5).choices(range(1000), k=120)
    alone, shared = Drafter(4, 2, 4), Drafter(4, 2, 4, history_n=8)
    for drafter in (alone, shared):
        first = request(text[:10])
        run(drafter, first, text[10:])
        drafter.finished(first)
    assert alone.stats.num_accepted_tokens == 0  # random text: no n-gram of it repeats
    second, again = request(text[:10]), request(text[:10])
    run(alone, second, text[10:])
    run(shared, again, text[10:])
    assert second.stats.accepted_draft_tokens == 0
    assert again.stats.accepted_draft_tokens == again.stats.draft_tokens > 80, again.stats
