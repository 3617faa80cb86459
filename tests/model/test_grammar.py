"""The grammar engine's interface (model/grammar.py): compile (cached, refusals with a reason), masks (one
bit per token, drafts' rows included), accept, roll back, complete."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from model.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    allowed_tokens,
    bitmask_words,
    fill_bitmasks,
)

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    return GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size, capacity=3)


def mask_of(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    fill_bitmasks([(matcher, 0, [])], bitmask)
    return allowed_tokens(bitmask, vocab_size)[0]


def test_a_compiled_grammar_is_cached_by_its_spec_and_the_cache_is_bounded(compiler):
    first = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    hits = compiler.stats.hits
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))) is first
    assert compiler.stats.hits == hits + 1
    for i in range(3):
        compiler.compile(GrammarSpec("regex", f"[0-9]{{{i + 1}}}"))
    assert compiler.compile(GrammarSpec.json_schema(SCHEMA)) is not first  # dropped: least recently used


@pytest.mark.parametrize(
    "spec,reason",
    [
        (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"not": {}}}}), "Unimplemented keys"),
        (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
        (GrammarSpec("regex", "a("), "unclosed group"),
        (GrammarSpec("grammar", "root ::= missing"), "missing"),
        (GrammarSpec("regex", "[^\\x00-\\U0010FFFF]"), "no text can match it"),
    ],
)
def test_a_grammar_that_does_not_compile_says_why(compiler, spec, reason):
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(spec)
    with pytest.raises(GrammarError, match=reason):  # the refusal is cached too
        compiler.compile(spec)


def test_the_mask_allows_exactly_the_tokens_that_keep_the_text_in_the_grammar(compiler, default_tokenizer):
    tok, V = default_tokenizer, default_tokenizer.vocab_size
    matcher = compiler.matcher(GrammarSpec.choice(["yes", "no"]))
    allowed = mask_of(matcher, V)
    expected = {t for t in range(V) if any(w.startswith(tok.decode([t])) and tok.decode([t]) for w in ("yes", "no"))}
    expected -= tok.special_ids
    assert set(allowed.nonzero()[:, 0].tolist()) == expected


def test_accept_rollback_and_completion(compiler, default_tokenizer):
    tok = default_tokenizer
    matcher = compiler.matcher(GrammarSpec.json_schema(SCHEMA))
    ids = tok.encode('{"n":42,"ok":true}')
    assert (
        matcher.valid_prefix(ids) == len(ids) and matcher.valid_prefix(tok.encode('{"x"')) == 2
    )  # '{', '"', then no key 'x'
    for t in ids[:-1]:
        assert matcher.accept(t) and not matcher.complete
    assert matcher.accept(ids[-1]) and matcher.complete  # the object closed: nothing but EOS may follow
    assert mask_of(matcher, tok.vocab_size).nonzero()[:, 0].tolist() == list(tok.eos_token_ids)
    matcher.rollback(3)
    assert not matcher.complete and matcher.valid_prefix(ids[-3:]) == 3
    fresh = compiler.matcher(GrammarSpec.json_schema(SCHEMA))  # each sequence starts at the start
    assert fresh.valid_prefix(ids) == len(ids) and matcher.error is None


def test_draft_rows_are_the_masks_after_each_allowed_draft_prefix(compiler, default_tokenizer):
    tok, V = default_tokenizer, default_tokenizer.vocab_size
    spec = GrammarSpec.json_schema(SCHEMA)
    draft = tok.encode('{"n":4x')  # allowed up to the 'x'
    valid = compiler.matcher(spec).valid_prefix(draft)
    assert 0 < valid < len(draft)
    batched = compiler.matcher(spec)
    other = compiler.matcher(GrammarSpec("regex", "[a-z]+"))
    bitmask = np.zeros((len(draft) + 2, bitmask_words(V)), dtype=np.int32)
    fill_bitmasks([(other, 0, []), (batched, 1, draft)], bitmask)
    rows = allowed_tokens(bitmask, V)
    reference = compiler.matcher(spec)
    for j in range(len(draft) + 1):
        if j <= valid:
            assert torch.equal(rows[1 + j], mask_of(reference, V)), f"draft row {j}"
            if j < valid:
                assert reference.accept(draft[j])
        else:
            assert rows[1 + j].all(), f"row {j}, past the forbidden draft token, allows everything"
    assert torch.equal(rows[0], mask_of(compiler.matcher(GrammarSpec("regex", "[a-z]+")), V))
    assert batched.valid_prefix(draft) == valid  # filling the draft's rows left the matcher where it was
