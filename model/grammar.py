"""Structured output: a grammar (a JSON schema, any JSON object, a regular expression, a choice of strings, an
EBNF or Lark grammar) compiled against a tokenizer, and one matcher per sequence that says which tokens may
come next (a bitmask, one bit per token) and follows the tokens chosen.

The engine behind this interface is llguidance: grammars compile fast, masks are computed lazily per step,
and the package depends on nothing else (`python -m bench.structured --compare` times it against xgrammar). The rest
of the code uses only what is here: `GrammarSpec` (what a request asks for: plain data that travels in its
SamplingParams), `GrammarCompiler.compile` (a spec checked and compiled, cached by its text in a bounded LRU),
`GrammarMatcher` (one sequence's state: accept a token, roll back, complete or not), `fill_bitmasks` (a batch's
masks, rows for speculative drafts included) and `allowed_tokens` / `forbidden_tokens` (bitmask rows as
boolean rows).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import llguidance
import numpy as np
import torch

from model.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
CACHE_CAPACITY = 256  # compiled grammars kept per tokenizer (least recently used dropped first)
# JSON as compact as json.dumps(separators=(",", ":")) writes it: no run of whitespace for a model to loop in.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that does not compile (bad syntax, an unsupported JSON Schema keyword...), with the reason."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `value` is text in every kind: the JSON schema (JSON text),
    the regular expression, the choices (a JSON list of strings), the grammar (EBNF in llama.cpp's GBNF form,
    or Lark); '' for json_object (any JSON object). 'lark' is Lark only (the tool-call grammars)."""

    kind: GrammarKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (one of {', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False))


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar definition (a JSON string); GrammarError if it cannot be read."""
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.value)
        return llguidance.grammar_from(spec.kind, spec.value)  # regex; grammar: GBNF converted, or Lark as it is
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - the converters raise ValueError, their own classes, or bare Exception
        raise GrammarError(str(e)) from e


class CompiledGrammar:
    """A grammar compiled for one tokenizer: a matcher at its start, copied for each sequence (a copy costs
    about a microsecond; the compile is what the cache saves)."""

    def __init__(self, pristine: llguidance.LLMatcher) -> None:
        self._pristine = pristine

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy())


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Follows a chosen token; False if the grammar forbids it (the matcher is then in error)."""
        return self._m.consume_token(token_id)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the state is unchanged)."""
        return self._m.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted tokens."""
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(self._m.get_error() or f"cannot roll back {num_tokens} tokens")

    @property
    def complete(self) -> bool:
        """The grammar is matched and allows nothing more (but EOS): the sequence ends here."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working (a forbidden token, a grammar too complex for the parser's limits)."""
        return _reason(self._m) if self._m.is_error() else None

    def fill(self, bitmask: np.ndarray, row: int = 0) -> None:
        """The tokens allowed next, into bitmask[row] ((rows, words) int32, one bit per token)."""
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a bitmask over `vocab_size` tokens (token t: bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


def fill_bitmasks(rows: list[tuple[GrammarMatcher, int, list[int]]], bitmask: np.ndarray) -> None:
    """Fills the masks of a batch, on the calling thread (the engine's mask thread, while its step's forward runs: one
    thread, as a pool of them would compete with the kernels' own). Each entry (matcher, row, draft) fills
    bitmask[row] with the tokens allowed now and, for a speculative draft of K tokens, bitmask[row + j] (j = 1..K)
    with those allowed after draft[:j], as long as the grammar allows draft[:j]; rows past a forbidden draft token
    allow every token (their picks are never kept). The matchers end where they started. bitmask: (rows, words)
    int32, C-contiguous."""
    for matcher, row, draft in rows:
        matcher.fill(bitmask, row)
        if not draft:
            continue
        valid = matcher.valid_prefix(draft)
        bitmask[row + 1 + valid : row + 1 + len(draft)] = -1
        for j in range(valid):
            matcher.accept(draft[j])
            matcher.fill(bitmask, row + 1 + j)
        matcher.rollback(valid)


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask rows as (rows, vocab_size) bool: True where the token is allowed."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")  # (rows, 32 * words)
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool: True where the token is forbidden (what a masked_fill takes)."""
    return allowed_tokens(~bitmask, vocab_size)


@dataclass
class CompileStats:
    compiles: int = 0  # grammars compiled (cache misses, failed ones included)
    hits: int = 0  # specs found compiled in the cache
    seconds: float = 0.0  # time spent compiling


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and vocabulary size (the model's: its logits may have more
    rows than the tokenizer has tokens), keeping the last CACHE_CAPACITY, keyed by the spec's text. A
    refused spec is cached too, so a client repeating a bad schema costs one compile. Thread-safe."""

    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _shared_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = CACHE_CAPACITY) -> None:
        self.tokenizer, self.vocab_size, self.capacity = tokenizer, vocab_size, capacity
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @classmethod
    def shared(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        """The compiler of this tokenizer and vocabulary size, one per process: the HTTP layer's checks and the
        engine's requests share its cache."""
        with cls._shared_lock:
            per_size = cls._shared.setdefault(tokenizer, {})
            if vocab_size not in per_size:
                per_size[vocab_size] = cls(tokenizer, vocab_size)
            return per_size[vocab_size]

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            eos = list(self.tokenizer.eos_token_ids)
            if not eos:
                raise GrammarError("structured output needs an EOS token, and this model's tokenizer names none")
            self._lltokenizer = llguidance.LLTokenizer(
                self.tokenizer.hf.to_str(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._lltokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, from the cache when it is there; GrammarError saying why it does not compile."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
            else:
                began = time.perf_counter()
                try:
                    found = CompiledGrammar(self._build(spec))
                except GrammarError as e:
                    found = e
                self.stats.compiles += 1
                self.stats.seconds += time.perf_counter() - began
                self._cache[spec] = found
                if len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A new sequence's matcher for `spec`."""
        return self.compile(spec).matcher()

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), _grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(_reason(matcher))
        first = np.empty((1, bitmask_words(self.vocab_size)), dtype=np.int32)
        GrammarMatcher(matcher).fill(first)  # the first mask: a grammar that matches no text at all fails here
        if matcher.is_error():
            raise GrammarError(f"no text can match it ({_reason(matcher)})")
        return matcher


def _reason(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's reason, without the parser state llguidance appends to some."""
    return (matcher.get_error() or "the grammar's matcher failed").split("\n<state>")[0].strip()
