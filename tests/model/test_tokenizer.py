"""Byte-level BPE round trips any text; streaming decode never splits or loses a character."""

from __future__ import annotations

import pytest

from model.tokenizer import TokenizerError

SAMPLES = [
    "Hello, world! Plain ASCII with punctuation; and numbers 12345.",
    "莎士比亚写了三十七部戏剧。天下大势，分久必合，合久必分。",
    "Emoji: 🤖🎭👩‍👩‍👧 and flags 🇬🇧, accents: naïve café, ﬁ ligature",
    "\n\n  tabs\tand   spaces  \n",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_pieces_concatenate_to_full_decode(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    stream = tiny_tokenizer.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tiny_tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_character_is_held_back_until_complete(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🦄")  # not in the tiny corpus: its bytes are never merged into one token
    assert len(ids) > 1, "the character must span several tokens for this test to mean anything"
    stream = tiny_tokenizer.stream()
    pieces = [stream.push(i) for i in ids]
    assert pieces[-1] == "🦄" and all(p == "" for p in pieces[:-1])


def test_default_tokenizer_round_trips_unseen_scripts(default_tokenizer):
    for text in SAMPLES:
        assert default_tokenizer.decode(default_tokenizer.encode(text)) == text


def test_out_of_range_id_raises_clear_error(tiny_tokenizer):
    with pytest.raises(TokenizerError, match="out of range"):
        tiny_tokenizer.decode([tiny_tokenizer.vocab_size])
    with pytest.raises(TokenizerError, match="out of range"):
        tiny_tokenizer.stream().push(-1)


def test_eos_is_a_special_token_skipped_in_streams(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    assert eos in tiny_tokenizer.special_ids
    assert tiny_tokenizer.stream(skip_special=True).push(eos) == ""
    assert tiny_tokenizer.decode([eos]) == "<|endoftext|>"
