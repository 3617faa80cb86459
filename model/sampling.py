"""Sampling, batched: each row of a step has its own parameters, and its randomness comes from its
seed and the index of the token it samples, never from a generator's state. A seeded request
therefore samples the same tokens alone or in any batch, after a retry, or after a preemption.

Per row, in order: penalties (repetition, presence, frequency) on a copy of the logits; a row under a
grammar (structured output) keeps only the tokens its grammar allows; greedy rows take the argmax;
sampled rows divide by the temperature, keep their top-k / nucleus set, and pick by inverse CDF with
one uniform draw u = splitmix64(seed, index) / 2^64. The reported logprob is the chosen token's under
the model's unmodified distribution (a grammar changes which token is picked, not what it is reported).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from model.grammar import GrammarSpec

# A temperature below this means greedy (smaller ones overflow float32 logits), as in vLLM; it is also the
# floor the API holds top_p and the repetition penalty at.
SAMPLING_EPS = 1e-5
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
SEED_BITS = 63  # a drawn seed fits a signed 64-bit integer, which every JSON client reads back


class SamplingError(ValueError):
    """Sampling parameters out of range."""


MAX_LOGPROBS = 20  # top alternatives a row may ask for, as OpenAI's and vLLM's default limit


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64  # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    repetition_penalty: float = 1.0  # 1 means off (CTRL / Hugging Face semantics, prompt and output tokens)
    presence_penalty: float = 0.0  # OpenAI's: minus this from a token's logit once it has been generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the number of times it has been generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    seed: int | None = None  # None: the engine draws one (a sampled request is still reproducible from it)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top alternatives (and their logprobs) reported for each generated token
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and its top k alternatives
    grammar: GrammarSpec | None = None  # structured output: what the generated text must match (model/grammar.py)

    def __post_init__(self) -> None:
        checks = [
            (
                "max_new_tokens",
                self.max_new_tokens >= 1 or (self.max_new_tokens == 0 and self.prompt_logprobs is not None),
                "must be >= 1 (0 only when scoring the prompt)",
            ),
            ("presence_penalty", math.isfinite(self.presence_penalty), "must be finite"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty), "must be finite"),
            ("logit_bias", all(math.isfinite(b) for _, b in self.logit_bias), "values must be finite"),
            ("logprobs", 0 <= self.logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be finite and >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be finite and > 0",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2**64)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "entries must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SamplingError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether its logits are changed before the pick (so the greedy fast path cannot pick for it)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


def resolve_seed(seed: int | None) -> int:
    """The request's seed, or one drawn for a request that gave none (reported back so it can be replayed)."""
    return seed if seed is not None else random.getrandbits(SEED_BITS)


def copy_seed(seed: int, copy: int) -> int:
    """The seed of copy `copy` of a request (OpenAI's n, best_of): splitmix64's output for (seed, copy), so n
    copies sample n different sequences, and the same n again for the same seed. (`copy` plain steps from
    the first's seed would start copy c on the first copy's own draws, shifted by c tokens: the draws of a
    seed are splitmix steps along the same sequence.)"""
    return _splitmix64((seed + copy * SPLITMIX_GAMMA) % 2**64) % 2**SEED_BITS if copy else seed


def _splitmix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def uniform_draws(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row: splitmix64 of (seed, token index), 53 bits. seeds, indices: (R,)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(SPLITMIX_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass
class SamplingBatch:
    """The parameters of a step's R sampling rows, as tensors on the logits' device."""

    temperature: torch.Tensor  # (R,) float32; greedy rows hold 1 (never used)
    top_k: torch.Tensor  # (R,) int64, 0 = off
    top_p: torch.Tensor  # (R,) float32, 1 = off
    uniform: torch.Tensor  # (R,) float64, each row's draw for the token it samples now
    sampled_rows: torch.Tensor | None  # (s,) int64 rows that sample; None: every row is greedy
    filtered: bool  # some sampled row has top_k or top_p on
    penalties: Penalties | None = None  # None: no row has one
    masked_rows: torch.Tensor | None = None  # (c,) int64 rows a grammar restricts, ascending; None: none is
    forbidden: torch.Tensor | None = None  # (c, V) bool, the tokens each of those rows may not pick

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        indices: list[int],
        device: torch.device | str = "cpu",
        penalties: Penalties | None = None,
    ) -> SamplingBatch:
        """From per-row params (the engine fills preallocated tensors instead; generate() and tests use this)."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        return cls(
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            uniform=torch.from_numpy(
                uniform_draws(np.array(seeds, dtype=np.uint64), np.array(indices, dtype=np.uint64))
            ).to(device),
            sampled_rows=torch.tensor(sampled, dtype=torch.long, device=device) if sampled else None,
            filtered=any(0 < params[i].top_k or params[i].top_p < 1 for i in sampled),
            penalties=penalties if any(p.penalized for p in params) else None,
        )


@dataclass
class Penalties:
    """What the logits of a step's R rows are changed by before the pick (each a no-op at its default)."""

    repetition: torch.Tensor  # (R,) float32, 1 = off
    presence: torch.Tensor  # (R,) float32, 0 = off
    frequency: torch.Tensor  # (R,) float32, 0 = off
    seen: torch.Tensor  # (R, V) bool: tokens in the row's prompt or output (the repetition penalty's)
    counts: torch.Tensor  # (R, V) float32: times each token was generated (presence and frequency)
    bias: torch.Tensor | None = None  # (R, V) float32 added to the logits; None: no row has a logit_bias

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (R, V). Repetition (CTRL), then presence and frequency (OpenAI), then the bias."""
        scores = apply_repetition_penalty(logits, self.seen, self.repetition)  # (R, V)
        scores = scores - self.presence[:, None] * (self.counts > 0) - self.frequency[:, None] * self.counts
        return scores + self.bias if self.bias is not None else scores

    @classmethod
    def for_sequence(
        cls,
        params: SamplingParams,
        token_ids: list[int],
        num_prompt: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> Penalties:
        """One row's, from its tokens so far (generate() and tests; the engine keeps them per row)."""
        seen = torch.zeros((1, vocab_size), dtype=torch.bool, device=device)
        seen[0, torch.tensor(token_ids, device=device)] = True
        counts = torch.zeros((1, vocab_size), device=device)
        if len(token_ids) > num_prompt:
            counts[0].index_add_(
                0,
                torch.tensor(token_ids[num_prompt:], device=device),
                torch.ones(len(token_ids) - num_prompt, device=device),
            )
        return cls(
            torch.tensor([params.repetition_penalty], device=device),
            torch.tensor([params.presence_penalty], device=device),
            torch.tensor([params.frequency_penalty], device=device),
            seen,
            counts,
            bias_rows([params], vocab_size, device),
        )


def bias_rows(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """(R, V) float32 of each row's logit_bias, or None when no row has one."""
    if not any(p.logit_bias for p in params):
        return None
    bias = torch.zeros((len(params), vocab_size), device=device)
    for row, p in enumerate(params):
        for token, value in p.logit_bias:
            bias[row, token] += value
    return bias


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits: (R, V); seen: (R, V) bool; penalty: (R,). Seen tokens' positive logits are divided by the
    penalty and negative ones multiplied, so a penalty > 1 always makes a seen token less likely."""
    p = penalty[:, None]  # (R, 1)
    penalised = torch.where(logits < 0, logits * p, logits / p)  # (R, V)
    return torch.where(seen, penalised, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) already divided by temperature; top_k: (B,) with 0 = off; top_p: (B,).
    Returns logits with every token outside each row's top-k / nucleus set at -inf."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=logits.device)  # (V,)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)  # (B,)
    drop = rank[None, :] >= k[:, None]  # (B, V)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)  # (B, V)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V): probability of strictly better tokens
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)  # 1 is off: cumsum rounds to 1 before the tail
    drop[:, 0] = False  # the best token always survives, however small top_p is
    filtered = sorted_logits.masked_fill(drop, float("-inf"))  # (B, V)
    return torch.full_like(logits, float("-inf")).scatter(-1, order, filtered)


def pick_by_inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """logits: (s, V) scaled and filtered; uniform: (s,) in [0, 1). The first token whose cumulative
    probability exceeds u: each token is picked with its probability."""
    probs = logits.softmax(dim=-1)  # (s, V)
    cdf = probs.double().cumsum(dim=-1)  # (s, V)
    target = uniform[:, None] * cdf[:, -1:]  # (s, 1)
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]  # (s,)
    return torch.where(picked < logits.shape[-1], picked, probs.argmax(dim=-1))  # u*total rounded up to total


def sample(
    logits: torch.Tensor, batch: SamplingBatch, logsumexp: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (R, V) float32. Returns tokens (R,) int64 and their logprobs (R,) float32 under the
    unmodified distribution. logsumexp: (R,) each row's, if the caller has it already."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1) if logsumexp is None else logsumexp  # (R,)
    scores = logits if batch.penalties is None else batch.penalties.apply(logits)  # (R, V)
    if batch.forbidden is not None:  # what a grammar forbids is never picked (new tensors: the logits stay)
        rows = batch.masked_rows
        if len(rows) == len(scores):  # every row: rows is 0..R-1
            scores = scores.masked_fill(batch.forbidden, float("-inf"))  # (R, V)
        else:
            scores = scores.index_put((rows,), scores[rows].masked_fill(batch.forbidden, float("-inf")))  # (R, V)
    tokens = scores.argmax(dim=-1)  # (R,): greedy for every row; sampled rows overwritten below
    if batch.sampled_rows is not None:
        rows = batch.sampled_rows
        scaled = scores[rows] / batch.temperature[rows, None]  # (s, V)
        if batch.filtered:
            scaled = filter_top_k_top_p(scaled, batch.top_k[rows], batch.top_p[rows])
        tokens[rows] = pick_by_inverse_cdf(scaled, batch.uniform[rows])
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - lse  # (R,)
    return tokens, logprobs


def top_logprobs(logits: torch.Tensor, lse: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row under the unmodified distribution: ids (R, k), logprobs (R, k)."""
    values, ids = logits.topk(k, dim=-1)  # (R, k), best first
    return ids, values - lse[:, None]
