"""Runs one scheduled step: the scheduled tokens of every request flattened into one batch, one
forward over all of them, then one batched sample for the requests that reached their last token.

The runner keeps a persistent row per running request: its block table and sampling parameters
sit in preallocated buffers, written when the request arrives or gains a block. Per step it fills the
token ids, positions, cache slots and sampling draws, makes one host-to-device copy (none on the
CPU) and one device-to-host copy of the results. It reads requests and never changes them (the
engine's update does), so a failed step can be rerun request by request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from model.gpt import GPT
from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import SamplingBatch, sample, uniform_draws
from server.engine.input_buffers import InputBuffers
from server.engine.request import Request
from server.engine.scheduler import SchedulerOutput

log = logging.getLogger("kvserve.runner")

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class Sampled:
    request: Request  # the request this token belongs to
    token_id: int  # the token sampled for it
    logprob: float  # its log-probability under the model's unmodified distribution
    error: str | None = None  # set when this row's logits were unusable (NaN, inf): the token means nothing


class ModelRunner:
    def __init__(self, model: GPT, cache: PagedKVCache, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.model, self.cache, self.device = model, cache, model.device
        self.block_size = cache.block_size
        self.max_rows = max_num_seqs
        self.max_blocks = -(-model.config.n_positions // self.block_size)
        self.vocab_size = model.config.vocab_size
        self._rows: dict[Request, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._row_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # block ids written to each row's table
        self._seen: torch.Tensor | None = None  # (rows, V) bool, made when a penalized request first arrives
        self._allocate(max(max_num_batched_tokens, model.config.n_positions))

    def _allocate(self, max_tokens: int) -> None:
        """(Re)builds the buffers for up to `max_tokens` tokens a step, keeping the rows' persistent state."""
        R, previous = self.max_rows, getattr(self, "buffers", None)
        self.max_tokens = max_tokens
        self.buffers = InputBuffers({
            "block_tables": (np.int32, (R, self.max_blocks)),  # persistent: per row
            "temperature": (np.float32, (R,)), "top_k": (np.int64, (R,)), "top_p": (np.float32, (R,)),
            "repetition_penalty": (np.float32, (R,)),
            "token_ids": (np.int64, (max_tokens,)), "positions": (np.int64, (max_tokens,)),
            "slot_mapping": (np.int64, (max_tokens,)),
            "query_start": (np.int32, (R + 1,)), "seq_lens": (np.int32, (R,)), "seq_rows": (np.int32, (R,)),
            "logits_rows": (np.int64, (R,)), "sample_rows": (np.int64, (R,)), "uniform": (np.float64, (R,)),
            "sampled_idx": (np.int64, (R,)),
        }, self.device)
        if previous is not None:
            for name in ("block_tables", "temperature", "top_k", "top_p", "repetition_penalty"):
                self.buffers.host[name][...] = previous.host[name]
        self._seeds = getattr(self, "_seeds", np.zeros(R, dtype=np.uint64))

    # ---- rows -------------------------------------------------------------------------------------

    def _row(self, req: Request) -> int:
        """The request's persistent row, created on its first step and synced with its block table."""
        row = self._rows.get(req)
        host = self.buffers.host
        if row is None:
            row = self._rows[req] = self._free_rows.pop()
            self._row_blocks[row] = 0
            p = req.params
            host["temperature"][row] = 1.0 if p.greedy else min(p.temperature, 1e30)  # inf and 1e30: uniform alike
            host["top_k"][row], host["top_p"][row] = p.top_k, p.top_p
            host["repetition_penalty"][row] = p.repetition_penalty
            self._seeds[row] = req.seed
            if p.penalized:
                self._remember_tokens(row, req.token_ids)
        have, need = self._row_blocks[row], len(req.block_ids)
        if need > have:
            host["block_tables"][row, have:need] = req.block_ids[have:]
            self._row_blocks[row] = need
        return row

    def release(self, req: Request) -> None:
        """Forgets a request that gave its blocks back (finished, preempted, aborted): its row is free."""
        row = self._rows.pop(req, None)
        if row is not None:
            self._free_rows.append(row)

    def _remember_tokens(self, row: int, token_ids: list[int]) -> None:
        if self._seen is None:
            self._seen = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        self._seen[row] = False
        self._seen[row, torch.tensor(token_ids, device=self.device)] = True

    # ---- one step ---------------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> tuple[StepBatch, list[Request]]:
        """Fills the step's buffers; returns the batch and the requests that sample, in row order."""
        entries = list(sched.num_tokens.items())
        S, N = len(entries), sum(n for _, n in entries)
        if N > self.max_tokens:
            self._allocate(max(N, 2 * self.max_tokens))
        host = self.buffers.host
        ids: list[int] = []
        starts = np.empty(S, dtype=np.int64)
        counts = np.empty(S, dtype=np.int64)
        rows = host["seq_rows"][:S]
        sampling: list[int] = []
        for i, (req, n) in enumerate(entries):
            rows[i] = self._row(req)
            start = req.num_computed
            ids += req.token_ids[start:start + n]
            starts[i], counts[i] = start, n
            if start + n == req.num_tokens:
                sampling.append(i)
        query_start = host["query_start"][:S + 1]
        query_start[0] = 0
        np.cumsum(counts, out=query_start[1:])
        host["seq_lens"][:S] = starts + counts
        seq_of_token = np.repeat(np.arange(S), counts)  # (N,)
        positions = host["positions"][:N]
        positions[:] = np.arange(N) - query_start[seq_of_token] + starts[seq_of_token]
        host["token_ids"][:N] = ids
        table = host["block_tables"][rows[seq_of_token], positions // self.block_size]  # (N,)
        host["slot_mapping"][:N] = table.astype(np.int64) * self.block_size + positions % self.block_size
        sample_reqs = [entries[i][0] for i in sampling]
        R = len(sampling)
        if R:
            host["logits_rows"][:R] = query_start[1:][sampling] - 1
            sample_rows = rows[sampling]
            host["sample_rows"][:R] = sample_rows
            indices = np.array([r.num_output_tokens for r in sample_reqs], dtype=np.uint64)
            host["uniform"][:R] = uniform_draws(self._seeds[sample_rows], indices)
            sampled = [i for i, r in enumerate(sample_reqs) if not r.params.greedy]
            host["sampled_idx"][:len(sampled)] = sampled
            self._num_sampled = len(sampled)
            self._filtered = any(sample_reqs[i].params.top_k > 0 or sample_reqs[i].params.top_p < 1 for i in sampled)
            self._penalized = any(r.params.penalized for r in sample_reqs)
        self.buffers.upload()
        t = self.buffers.tensors
        step = StepBatch(token_ids=t["token_ids"][:N], positions=t["positions"][:N],
                         slot_mapping=t["slot_mapping"][:N], query_start=t["query_start"][:S + 1],
                         seq_lens=t["seq_lens"][:S], block_tables=t["block_tables"], seq_rows=t["seq_rows"][:S],
                         max_query_len=int(counts.max()) if S else 0,
                         max_seq_len=int((starts + counts).max()) if S else 0)
        return step, sample_reqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[Sampled]:
        step, reqs = self.prepare(sched)
        hidden = self.model.forward_step(step, self.cache)  # (N, C)
        R = len(reqs)
        if not R:
            return []
        t = self.buffers.tensors
        logits = self.model.compute_logits(hidden[t["logits_rows"][:R]])  # (R, V) float32
        tokens, logprobs, broken = self._sample(logits, t, R)
        values = torch.stack([tokens.double(), logprobs.double(), broken.double()]).tolist()  # the one copy back
        return [Sampled(req, int(tok), lp, NON_FINITE if bad else None)
                for req, tok, lp, bad in zip(reqs, *values)]

    def _sample(self, logits: torch.Tensor, t: dict[str, torch.Tensor], R: int):
        rows = t["sample_rows"][:R]
        penalty = t["repetition_penalty"][rows] if self._penalized else None  # (R,)
        batch = SamplingBatch(
            temperature=t["temperature"][rows], top_k=t["top_k"][rows], top_p=t["top_p"][rows],
            uniform=t["uniform"][:R], sampled_rows=t["sampled_idx"][:self._num_sampled] if self._num_sampled else None,
            filtered=self._filtered, repetition_penalty=penalty, seen=self._seen[rows] if self._penalized else None)
        lse = torch.logsumexp(logits, dim=-1)  # (R,); row-invariant on the CPU (tests/model/test_kernels.py)
        broken = ~lse.isfinite()  # (R,): such a row fails its request, not the batch
        if self.device.type != "cpu" or broken.any():  # (on a GPU, testing would cost a sync)
            logits = logits.masked_fill(broken[:, None], 0.0)
            lse = torch.where(broken, float(np.log(self.vocab_size)), lse)
        tokens, logprobs = sample(logits, batch, lse)
        if penalty is not None:
            keep = penalty != 1.0  # (R,)
            self._seen[rows[keep], tokens[keep]] = True  # the sampled token joins the history for the next step
        return tokens, logprobs, broken
