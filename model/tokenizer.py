"""Byte-level BPE tokenizer (the `tokenizers` library) and incremental detokenization for streaming.

A prompt's special tokens (a BOS before it) come from the tokenizer's post-processor, set as transformers
sets it (`prompt_special_tokens`); the chat template and the BOS/EOS texts from tokenizer_config.json
(model.checkpoint.load_tokenizer reads them)."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """Text or token ids the tokenizer cannot handle."""


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table used by the ByteLevel pre-tokenizer."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; knows each token's exact bytes so streaming is lossless."""

    def __init__(
        self,
        hf: HFTokenizer,
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        model_vocab_size: int | None = None,
        tokenizer_class: str | None = None,
    ) -> None:
        """`eos_token_ids`: the ids that end a sequence, as the checkpoint names them (checkpoint.load_tokenizer);
        none given, the id of `eos_token`, else of `<|endoftext|>`, if the vocabulary has it. `bos_token`,
        `eos_token`: the texts tokenizer_config.json names (a chat template writes them). `model_vocab_size`:
        the model's logits, when more than the tokenizer's ids (Qwen's): the ids past the tokenizer's decode to
        nothing. `tokenizer_class`: tokenizer_config.json's, the transformers class that loads it."""
        self.hf = hf
        self.tokenizer_class = tokenizer_class
        self.chat_template = chat_template  # a Jinja template for chat messages (tokenizer_config.json), if any
        self.vocab_size = max(hf.get_vocab_size(with_added_tokens=True), model_vocab_size or 0)
        if not eos_token_ids:
            default = hf.token_to_id(eos_token or EOS_TOKEN)
            eos_token_ids = () if default is None else (default,)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)  # any of them ends a sequence
        self.bos_token, self._eos_token = bos_token, eos_token
        self.special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
        self._token_bytes = [self._bytes_of(i) for i in range(self.vocab_size)]

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id: the one written where one is needed (a chat template's eos_token, training text)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def eos_token(self) -> str | None:
        """The EOS text a chat template writes: tokenizer_config.json's, else the first EOS id's."""
        if self._eos_token is not None:
            return self._eos_token
        return None if self.eos_token_id is None else self.decode([self.eos_token_id])

    @property
    def bos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's bos_token (None where it names none)."""
        return None if self.bos_token is None else self.hf.token_to_id(self.bos_token)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")  # an added, non-byte-level token

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(read_tokenizer_file(path))

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids; with `add_special_tokens`, those the tokenizer puts around a prompt (a BOS before it
        where the checkpoint's tokenizer adds one: `prompt_special_tokens`). A chat template writes its own,
        so text rendered from one is encoded without."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self, token_id: int) -> bytes:
        self.check_ids([token_id])
        return self._token_bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = list(ids)
        self.check_ids(ids)
        data = b"".join(self._token_bytes[i] for i in ids if not (skip_special and i in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def check_ids(self, ids: Iterable[int]) -> None:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is out of range [0, {self.vocab_size})")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


def prompt_special_tokens(
    hf: HFTokenizer,
    add_bos_token: bool | None,
    add_eos_token: bool | None,
    bos_token: str | None,
    eos_token: str | None,
) -> None:
    """Sets the special tokens `hf.encode(..., add_special_tokens=True)` puts around a prompt. tokenizer.json's
    post-processor, where it has one, decides, whatever tokenizer_config.json says: transformers 5 reads a
    checkpoint so (Llama 3's adds <|begin_of_text|>, Qwen's and GPT-2's add nothing), and a BOS is never added
    twice. Without one, tokenizer_config.json's add_bos_token and add_eos_token do, as transformers 4's Llama
    tokenizers read them (transformers 5 then adds nothing). TokenizerError for a token to add that is not in
    the vocabulary."""
    if hf.post_processor is not None:
        return
    added = []
    for name, wanted, token in (("bos_token", add_bos_token, bos_token), ("eos_token", add_eos_token, eos_token)):
        if not wanted or token is None:
            continue
        token_id = hf.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"add_{name} is true, but its {name} {token!r} is not in the vocabulary")
        added.append((name, token, token_id))
    if not added:
        return
    before = [f"{token}:0" for name, token, _ in added if name == "bos_token"]
    after = [f"{token}:0" for name, token, _ in added if name == "eos_token"]
    hf.post_processor = processors.TemplateProcessing(
        single=" ".join([*before, "$A:0", *after]),
        special_tokens=list(dict.fromkeys((token, token_id) for _, token, token_id in added)),
    )


def read_tokenizer_file(path: str | Path) -> HFTokenizer:
    """The `tokenizers` tokenizer saved at `path`; TokenizerError naming the file if it cannot be read or parsed
    (the library's own message names neither)."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust library raises a bare Exception for I/O and parse errors
        raise TokenizerError(f"{path} cannot be read as a tokenizer: {e}") from e


class StreamDecoder:
    """Turns token ids into text one at a time; holds back an incomplete UTF-8 character until the
    bytes that finish it arrive, so the pieces always concatenate to exactly `decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text newly completed by this token ('' while a character is still incomplete)."""
        if self.skip_special and token_id in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (replacement chars for a torn tail)."""
        return self._utf8.decode(b"", final=True)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Trains a byte-level BPE with GPT-2's pre-tokenization and `<|endoftext|>` as id 0."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
