"""Per-row sampling for a batch: each row has its own parameters and its own random generator."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


GREEDY_BELOW = 1e-5  # smaller temperatures overflow float32 logits; they mean greedy, as in vLLM


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    repetition_penalty: float = 1.0  # 1 means off (CTRL / Hugging Face semantics)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be finite and >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be finite and > 0",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "entries must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SamplingError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits: (V,); seen: (n,) token ids already in the sequence. Positive logits are divided by the
    penalty and negative ones multiplied, so a penalty > 1 always makes a seen token less likely."""
    scores = logits.gather(0, seen)  # (n,)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(0, seen, scores)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: (B, V) already divided by temperature; top_k: (B,) with 0 = off; top_p: (B,).
    Returns logits with every token outside each row's top-k / nucleus set to -inf."""
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks one token per row. logits: (B, V). histories[i]: (n_i,) ids seen by row i (for the
    repetition penalty). Returns (tokens (B,), logprobs (B,)), the logprob under the model's
    unmodified distribution."""
    logits = logits.float()
    B = logits.shape[0]
    logprobs_all = logits.log_softmax(dim=-1)  # (B, V)
    penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and histories is not None]
    if penalised:
        logits = logits.clone()
        for i in penalised:
            if histories[i].numel():
                logits[i] = apply_repetition_penalty(logits[i], histories[i], params[i].repetition_penalty)
    tokens = logits.argmax(dim=-1)  # (B,) greedy for every row; sampled rows overwritten below
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)  # (b,)
        top_k = torch.tensor([params[i].top_k for i in rows], device=logits.device)  # (b,)
        top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)  # (b,)
        scaled = logits[index] / temps[:, None]  # (b, V)
        if any(0 < params[i].top_k < logits.shape[-1] or params[i].top_p < 1 for i in rows):  # else skip the sort
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)  # (b, V)
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    logprobs = logprobs_all.gather(1, tokens[:, None])[:, 0]  # (B,)
    return tokens, logprobs


class StopMatcher:
    """Finds stop strings in streamed text, even when they span tokens, and never lets one leak:
    text that could still be the start of a stop string is held back until it is decided."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(stop)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Text now safe to emit. After a match, `matched` is set and the rest is dropped."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        self._held += text
        hits = [(self._held.find(s), s) for s in self.stop if s in self._held]
        if hits:
            at, s = min(hits)
            self.matched = s
            out, self._held = self._held[:at], ""
            return out
        keep = max((self._longest_prefix_suffix(s) for s in self.stop), default=0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        out, self._held = ("" if self.matched else self._held), ""
        return out

    def _longest_prefix_suffix(self, stop: str) -> int:
        for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
            if self._held.endswith(stop[:n]):
                return n
        return 0
