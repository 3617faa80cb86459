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
from model.sampling import top_logprobs
from server.engine.input_buffers import InputBuffers
from server.engine.request import PromptLogprob, Request
from server.engine.sampler import RESULT_COLUMNS, Sampler
from server.engine.scheduler import SchedulerOutput

log = logging.getLogger("kvserve.runner")

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class Sampled:
    request: Request  # the request this token belongs to
    token_id: int  # the token sampled for it
    logprob: float  # its log-probability under the model's unmodified distribution
    error: str | None = None  # set when this row's logits were unusable (NaN, inf): the token means nothing
    top: list[tuple[int, float]] | None = None  # the most likely tokens and their logprobs, when asked for


@dataclass
class StepResult:
    sampled: list[Sampled]  # one per request that reached the end of its tokens and generates
    prompt_logprobs: dict[Request, list[PromptLogprob]]  # per request that asked: its prompt positions this step


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
        self.sampler = Sampler(max_num_seqs, self.vocab_size, self.device, exact=model.kernels == "exact")
        self._all_rows_sample = False
        self._allocate(max(max_num_batched_tokens, model.config.n_positions))

    def _allocate(self, max_tokens: int) -> None:
        """(Re)builds the buffers for up to `max_tokens` tokens a step, keeping the rows' persistent state."""
        R, previous = self.max_rows, getattr(self, "buffers", None)
        self.max_tokens = max_tokens
        self._arange = np.arange(max(max_tokens, R) + 1)
        self.buffers = InputBuffers({
            "block_tables": (np.int32, (R, self.max_blocks)),  # persistent: per row
            "temperature": (np.float32, (R,)), "top_k": (np.int64, (R,)), "top_p": (np.float32, (R,)),
            "repetition_penalty": (np.float32, (R,)), "presence_penalty": (np.float32, (R,)),
            "frequency_penalty": (np.float32, (R,)),
            "token_ids": (np.int64, (max_tokens,)), "positions": (np.int64, (max_tokens,)),
            "slot_mapping": (np.int64, (max_tokens,)),
            "query_start": (np.int32, (R + 1,)), "seq_lens": (np.int32, (R,)), "seq_rows": (np.int32, (R,)),
            "logits_rows": (np.int64, (R,)), "sample_rows": (np.int64, (R,)), "uniform": (np.float64, (R,)),
            "sampled_idx": (np.int64, (R,)),
        }, self.device)
        if previous is not None:
            for name in ("block_tables", "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty"):
                self.buffers.host[name][...] = previous.host[name]

    # ---- rows -------------------------------------------------------------------------------------

    def _row(self, req: Request) -> int:
        """The request's persistent row, created on its first step and synced with its block table."""
        row = self._rows.get(req)
        host = self.buffers.host
        if row is None:
            row = self._rows[req] = self._free_rows.pop()
            self._row_blocks[row] = 0
            self.sampler.add_row(row, req, host)
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

    # ---- one step ---------------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> tuple[StepBatch, list[Request]]:
        """Fills the step's buffers; returns the batch and the requests that sample, in row order."""
        self.buffers.wait_copied()
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
            if start + n == req.num_tokens and req.params.max_new_tokens > 0:
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
        self._plan = None
        if R:
            host["logits_rows"][:R] = query_start[1:][sampling] - 1
            host["sample_rows"][:R] = host["seq_rows"][:S][sampling]
            self._plan = self.sampler.plan(sample_reqs, host)
        self._prompt_scoring = self._plan_prompt_logprobs(sched, starts, query_start)
        self.buffers.upload()
        t = self.buffers.tensors
        step = StepBatch(t["token_ids"], t["positions"], t["slot_mapping"], t["query_start"], t["seq_lens"],
                         t["block_tables"], t["seq_rows"], N, S, max(counts) if S else 0,
                         int(seq_lens.max()) if S else 0)
        return step, sample_reqs

    def _plan_prompt_logprobs(self, sched: SchedulerOutput, starts: list[int], query_start: np.ndarray):
        """For requests that asked for prompt logprobs: the step rows whose logits score a prompt token
        (position p's logits give token p + 1's logprob), as (rows, targets, owners)."""
        rows, targets, owners = [], [], []
        for i, (req, n) in enumerate(sched.num_tokens.items()):
            if req.params.prompt_logprobs is None:
                continue
            start, end = starts[i], min(starts[i] + n, req.num_prompt_tokens - 1)
            if start >= end:
                continue
            first = int(query_start[i])
            rows += range(first, first + end - start)
            targets += req.token_ids[start + 1:end + 1]
            owners.append((req, start + 1, end - start))  # positions start + 1 .. end are scored
        return (rows, targets, owners) if rows else None

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        step, reqs = self.prepare(sched)
        hidden = self.model.forward_step(step, self.cache)  # (N, C)
        prompt_logprobs = self._score_prompts(hidden) if self._prompt_scoring else {}
        R = len(reqs)
        if not R:
            return StepResult([], prompt_logprobs)
        t = self.buffers.tensors
        rows = hidden if self._all_rows_sample else hidden[t["logits_rows"][:R]]  # (R, C)
        logits = self.model.compute_logits(rows)  # (R, V) float32
        values = self.sampler.sample(logits, self._plan, t).tolist()  # the one copy back
        k = self._plan.top_k
        sampled = []
        for req, row in zip(reqs, values):
            top = list(zip(map(int, row[RESULT_COLUMNS:RESULT_COLUMNS + k]), row[RESULT_COLUMNS + k:]))
            sampled.append(Sampled(req, int(row[0]), row[1], None if row[2] else NON_FINITE,
                                   top[:req.params.logprobs] if req.params.logprobs else None))
        return StepResult(sampled, prompt_logprobs)

    def _score_prompts(self, hidden: torch.Tensor) -> dict[Request, list[PromptLogprob]]:
        """The logprob of each prompt token the step's rows predict (and the top alternatives), for the
        requests that asked: from the same forward, their rows' logits, (P, V) for P scored positions."""
        rows, targets, owners = self._prompt_scoring
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])  # (P, V)
        lse = torch.logsumexp(logits, dim=-1)  # (P,)
        target = torch.tensor(targets, device=self.device)  # (P,)
        chosen = logits.gather(1, target[:, None])[:, 0] - lse  # (P,)
        k = max(req.params.prompt_logprobs for req, _, _ in owners)
        columns = [chosen[:, None].double()]
        if k:
            ids, values = top_logprobs(logits, lse, k)  # (P, k)
            columns += [ids.double(), values.double()]
        table = torch.cat(columns, dim=1).tolist()  # (P, 1 + 2k)
        out, at = {}, 0
        for req, first, count in owners:
            want = req.params.prompt_logprobs
            out[req] = [PromptLogprob(first + j, targets[at + j], table[at + j][0],
                                      list(zip(map(int, table[at + j][1:1 + want]), table[at + j][1 + k:1 + k + want]))
                                      if want else None) for j in range(count)]
            at += count
        return out
