"""Executes one scheduled step: batched forwards for prefill chunks, cached decode and uncached
recompute, then one sampled token per request that has reached the end of its prompt."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model.generate import decode_one_token, prefill
from model.gpt import GPT
from model.kv_cache import KVCache, slot_index
from model.sampling import sample
from server.scheduler import PrefillChunk, SchedulerOutput
from server.sequence import Sequence


log = logging.getLogger("kvserve.runner")

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class Sampled:
    seq: Sequence  # the request this token belongs to
    token_id: int  # the token sampled for it
    logprob: float  # its log-probability under the model's unmodified distribution
    error: str | None = None  # set when this row's logits were unusable (NaN, inf): the token means nothing


class ModelRunner:
    """Owns no request state: reads the scheduled sequences, never changes them (the engine's update
    step does), so a step that fails can be rerun request by request."""

    def __init__(self, model: GPT, cache: KVCache, compiled: bool = False) -> None:
        self.model, self.cache, self.compiled = model, cache, compiled
        self.device = next(model.parameters()).device
        self._no_history = torch.empty(0, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[Sampled]:
        seqs: list[Sequence] = []
        logits: list[torch.Tensor] = []
        if batch.prefill:
            done = [i for i, c in enumerate(batch.prefill) if c.end == len(c.seq.prompt_ids)]
            chunk_logits = self._prefill(batch.prefill)  # (b, V)
            if done:
                logits.append(chunk_logits[torch.tensor(done, device=self.device)])  # (d, V)
                seqs += [batch.prefill[i].seq for i in done]
        if batch.decode:
            decode = sorted(batch.decode, key=lambda s: s.slot)  # in slot order, often one contiguous range
            logits.append(self._decode(decode))  # (b, V)
            seqs += decode
        if batch.recompute:
            logits.append(self._recompute(batch.recompute))  # (b, V)
            seqs += batch.recompute
        if not seqs:
            return []
        all_logits = torch.cat(logits)  # (N, V)
        broken = ~all_logits.isfinite().all(dim=-1)  # (N,): such a row fails its request, not the batch
        if broken.any():
            all_logits = all_logits.masked_fill(broken[:, None], 0.0)
        tokens, logprobs = sample(all_logits, [s.params for s in seqs], [s.generator for s in seqs],
                                  [self._history(s) for s in seqs])  # (N,), (N,)
        return [Sampled(s, t, lp, NON_FINITE if bad else None)
                for s, t, lp, bad in zip(seqs, tokens.tolist(), logprobs.tolist(), broken.tolist())]

    def _prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Ragged prompt chunks, right-padded with position -1. Returns each row's last logits (B, V)."""
        B, T = len(chunks), max(c.end - c.start for c in chunks)
        ids = torch.zeros((B, T), dtype=torch.long)  # (B, T)
        positions = torch.full((B, T), -1, dtype=torch.long)  # (B, T), -1 = padding
        for i, c in enumerate(chunks):
            n = c.end - c.start
            ids[i, :n] = torch.tensor(c.seq.prompt_ids[c.start:c.end])
            positions[i, :n] = torch.arange(c.start, c.end)
        last = torch.tensor([c.end - c.start - 1 for c in chunks])  # (B,)
        kv_len = max(c.end for c in chunks)  # attend only over columns some row has written
        return prefill(self.model, self.cache, ids.to(self.device), positions.to(self.device),
                       self._slots([c.seq.slot for c in chunks]), last.to(self.device), kv_len=kv_len)  # (B, V)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        tokens = torch.tensor([s.output_ids[-1] for s in seqs])  # (B,)
        positions = torch.tensor([len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs])  # (B,)
        kv_len = int(positions.max()) + 1
        args = (self.model, self.cache, tokens.to(self.device), positions.to(self.device),
                self._slots([s.slot for s in seqs]))
        if self.compiled:
            try:
                return decode_one_token(*args, kv_len=kv_len, compiled=True)  # (B, V)
            except Exception as e:
                self.fall_back_to_eager(e)
        return decode_one_token(*args, kv_len=kv_len)  # (B, V)

    def fall_back_to_eager(self, error: Exception) -> None:
        """A decode variant failed to compile (no C++ compiler, an unsupported op): serve eagerly rather
        than not at all; every later step decodes without torch.compile."""
        log.warning("torch.compile of the decode step failed, decoding without it: %s", error)
        self.compiled = False

    def _recompute(self, seqs: list[Sequence]) -> torch.Tensor:
        """The whole sequence of every row again through the uncached ragged path (no KV cache)."""
        rows = [s.all_ids for s in seqs]
        B, T = len(rows), max(len(r) for r in rows)
        ids = torch.zeros((B, T), dtype=torch.long)  # (B, T)
        positions = torch.full((B, T), -1, dtype=torch.long)  # (B, T), -1 = padding
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            positions[i, : len(r)] = torch.arange(len(r))
        last = torch.tensor([len(r) - 1 for r in rows])  # (B,)
        return self.model(ids.to(self.device), positions.to(self.device), logits_index=last.to(self.device))  # (B, V)

    @torch.inference_mode()  # as in execute: the compiled graphs are guarded on it
    def compile_decode_variants(self) -> None:
        """Runs a compiled decode step in each variant the engine meets (one row or more; slots a range
        from slot 0, from slot 1, from another, or a gather), so that no request waits for a compile.
        Writes only to free slots (up to 4 of them), and zeroes them again."""
        slots = [self.cache.allocate() for _ in range(min(4, self.cache.num_free))]
        try:
            for rows in ([0], [0, 1], [1], [1, 2], [2], [2, 3], [0, 2]):
                if max(rows) >= len(slots):
                    continue
                tokens = torch.zeros(len(rows), dtype=torch.long, device=self.device)  # (b,)
                positions = torch.ones(len(rows), dtype=torch.long, device=self.device)  # (b,)
                decode_one_token(self.model, self.cache, tokens, positions, self._slots([slots[r] for r in rows]),
                                 kv_len=2, compiled=True)
        finally:
            for slot in slots:
                self.cache.free(slot)

    def _slots(self, slots: list[int]) -> slice | torch.Tensor:
        """A slice when the slots are one contiguous range (attention reads a view), else a tensor (a gather)."""
        return slot_index(slots) or torch.tensor(slots, device=self.device)

    def _history(self, seq: Sequence) -> torch.Tensor:
        if seq.params.repetition_penalty == 1.0:
            return self._no_history
        return torch.tensor(seq.all_ids, device=self.device)  # (n,)
