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

from model import kernels
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
        self._exact = model.kernels == "exact"
        self._results = torch.zeros((max_num_seqs, 3), dtype=torch.float64, device=self.device)
        self._lse_out = torch.zeros(max_num_seqs, dtype=torch.float32, device=self.device)
        self._num_sampled, self._penalized, self._filtered, self._all_rows_sample = 0, False, False, False
        self._allocate(max(max_num_batched_tokens, model.config.n_positions))

    def _allocate(self, max_tokens: int) -> None:
        """(Re)builds the buffers for up to `max_tokens` tokens a step, keeping the rows' persistent state."""
        R, previous = self.max_rows, getattr(self, "buffers", None)
        self.max_tokens = max_tokens
        self._arange = np.arange(max(max_tokens, R) + 1)
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
        host = self.buffers.host
        rows, starts, counts, ids, sampling = [], [], [], [], []
        for i, (req, n) in enumerate(sched.num_tokens.items()):
            rows.append(self._row(req))
            start = req.num_computed
            starts.append(start)
            counts.append(n)
            if n == 1:
                ids.append(req.token_ids[start])
            else:
                ids += req.token_ids[start:start + n]
            if start + n == req.num_tokens:
                sampling.append(i)
        S, N = len(rows), len(ids)
        if N > self.max_tokens:
            self._allocate(max(N, 2 * self.max_tokens))
            host = self.buffers.host
        host["seq_rows"][:S] = rows
        host["token_ids"][:N] = ids
        positions, seq_lens, query_start = host["positions"][:N], host["seq_lens"][:S], host["query_start"][:S + 1]
        if N == S:  # one token per sequence: decode rows
            positions[:] = starts
            query_start[:] = self._arange[:S + 1]
            token_rows = host["seq_rows"][:S]
        else:
            start_of, count_of = np.array(starts), np.array(counts)
            query_start[0] = 0
            np.cumsum(count_of, out=query_start[1:])
            seq_of_token = np.repeat(self._arange[:S], count_of)  # (N,)
            positions[:] = self._arange[:N] - query_start[seq_of_token] + start_of[seq_of_token]
            token_rows = host["seq_rows"][:S][seq_of_token]
        np.add(positions[query_start[1:] - 1], 1, out=seq_lens, casting="unsafe")  # last position + 1
        block, offset = np.divmod(positions, self.block_size)
        host["slot_mapping"][:N] = host["block_tables"][token_rows, block] * self.block_size + offset
        if len(sampling) == S:
            sample_reqs = list(sched.num_tokens)
        else:
            chosen = set(sampling)
            sample_reqs = [req for i, req in enumerate(sched.num_tokens) if i in chosen]
        R = len(sample_reqs)
        self._all_rows_sample = R == N
        if R:
            host["logits_rows"][:R] = query_start[1:][sampling] - 1
            host["sample_rows"][:R] = host["seq_rows"][:S][sampling]
            sampled = [i for i, r in enumerate(sample_reqs) if not r.params.greedy]
            self._num_sampled = len(sampled)
            self._penalized = any(r.params.penalized for r in sample_reqs)
            if sampled:
                host["sampled_idx"][:len(sampled)] = sampled
                indices = np.array([r.num_output_tokens for r in sample_reqs], dtype=np.uint64)
                host["uniform"][:R] = uniform_draws(self._seeds[host["sample_rows"][:R]], indices)
                self._filtered = any(sample_reqs[i].params.top_k > 0 or sample_reqs[i].params.top_p < 1
                                     for i in sampled)
        self.buffers.upload()
        t = self.buffers.tensors
        step = StepBatch(t["token_ids"], t["positions"], t["slot_mapping"], t["query_start"], t["seq_lens"],
                         t["block_tables"], t["seq_rows"], N, S, max(counts) if S else 0,
                         int(seq_lens.max()) if S else 0)
        return step, sample_reqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[Sampled]:
        step, reqs = self.prepare(sched)
        hidden = self.model.forward_step(step, self.cache)  # (N, C)
        R = len(reqs)
        if not R:
            return []
        t = self.buffers.tensors
        rows = hidden if self._all_rows_sample else hidden[t["logits_rows"][:R]]  # (R, C)
        logits = self.model.compute_logits(rows)  # (R, V) float32
        values = self._sample(logits, t, R).tolist()  # the one copy back: (R, 3) token, logprob, finite
        return [Sampled(req, int(tok), lp, None if ok else NON_FINITE) for req, (tok, lp, ok) in zip(reqs, values)]

    def _sample(self, logits: torch.Tensor, t: dict[str, torch.Tensor], R: int) -> torch.Tensor:
        """(R, 3) float64: each row's token, its logprob and 1 if its logits were finite."""
        out, lse = self._results[:R], self._lse_out[:R]
        if self._exact:
            kernels.greedy(logits, out, lse)  # every row's argmax and normalizer, in one pass
        else:
            torch.logsumexp(logits, dim=-1, out=lse)  # row-invariant on the CPU (tests/model/test_kernels.py)
            greedy = logits.argmax(dim=-1)  # (R,)
            out[:, 0] = greedy
            out[:, 1] = logits.gather(1, greedy[:, None])[:, 0] - lse
            out[:, 2] = lse.isfinite()
        if not (self._num_sampled or self._penalized):
            return out
        rows = t["sample_rows"][:R]
        penalty = t["repetition_penalty"][rows] if self._penalized else None  # (R,)
        batch = SamplingBatch(
            temperature=t["temperature"][rows], top_k=t["top_k"][rows], top_p=t["top_p"][rows],
            uniform=t["uniform"][:R], sampled_rows=t["sampled_idx"][:self._num_sampled] if self._num_sampled else None,
            filtered=self._filtered, repetition_penalty=penalty, seen=self._seen[rows] if self._penalized else None)
        broken = out[:, 2] == 0  # (R,): such a row fails its request, not the batch
        logits = logits.masked_fill(broken[:, None], 0.0)
        tokens, logprobs = sample(logits, batch, torch.where(broken, float(np.log(self.vocab_size)), lse))
        out[:, 0], out[:, 1] = tokens, logprobs
        if penalty is not None:
            keep = penalty != 1.0  # (R,)
            self._seen[rows[keep], tokens[keep]] = True  # the sampled token joins the history for the next step
        return out
