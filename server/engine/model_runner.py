"""Runs one scheduled step: the scheduled tokens of every request flattened into one batch, one
forward over all of them, then one batched sample for the requests that reached their last token.

Each running request holds a row (given at admission by the scheduler): its block table sits in a
preallocated buffer here, its sampling state in the sampler's, both written when it is admitted or
gains a block. `prepare` fills the step's token ids, positions and cache slots and returns one
`StepInputs`; `execute` runs it: one host-to-device copy (none on the CPU), one forward, one
device-to-host copy of the results. The runner reads requests and never changes them (the engine's
update does), so a failed step can be rerun request by request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from model.description import InferenceModel, ModelDescription
from model.kv_cache import PagedKVCache, StepBatch
from server.engine.input_buffers import InputBuffers
from server.engine.prompt_scoring import PromptScoring, plan_prompt_scoring, score_prompts
from server.engine.request import PromptLogprob, Request
from server.engine.sampler import Sampled, Sampler, SamplingArgs
from server.engine.scheduler import SchedulerOutput
from server.engine.speculative import accepted_length

log = logging.getLogger("kvserve.runner")


@dataclass
class StepInputs:
    """Everything one step's execution reads, as `prepare` left it (tensors: views of step buffers)."""

    batch: StepBatch  # the flattened forward: token ids, positions, cache slots, block tables
    sampling: SamplingArgs | None  # the pick for the requests that reach their last token; None: none does
    logits_rows: torch.Tensor | None  # (R,) int64 step rows whose logits are sampled; None: all N rows, in order
    prompt_scoring: PromptScoring | None  # the rows that score prompt tokens; None: no request asked this step


@dataclass
class StepResult:
    sampled: list[Sampled]  # per request that reached the end of its tokens and generates: its new tokens, in order
    prompt_logprobs: dict[Request, list[PromptLogprob]]  # per request that asked: its prompt positions this step
    verified: dict[Request, tuple[int, int]] = field(default_factory=dict)  # drafting request -> (drafted, accepted)


class ModelRunner:
    def __init__(
        self,
        model: InferenceModel,
        served: ModelDescription,
        cache: PagedKVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        """`served`: the model as the engine serves it (its context may be shorter than the model's own)."""
        self.model, self.cache, self.device = model, cache, model.device
        self.block_size = cache.block_size
        self.max_rows = max_num_seqs
        self.max_blocks = -(-served.context_length // self.block_size)
        self._row_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # block ids written to each row's table
        self.sampler = Sampler(
            max_num_seqs,
            served.vocab_size,
            self.device,
            exact=model.kernels == "exact",
            max_samples=max_num_seqs * (1 + num_speculative_tokens),
        )
        self._allocate(max(max_num_batched_tokens, served.context_length))

    def _allocate(self, max_tokens: int) -> None:
        """(Re)builds the step buffers for up to `max_tokens` tokens a step, keeping the rows' block tables."""
        R, previous = self.max_rows, getattr(self, "buffers", None)
        self.max_tokens = max_tokens
        self._arange = np.arange(max(max_tokens, R) + 1)
        self.buffers = InputBuffers(
            {
                "block_tables": (np.int32, (R, self.max_blocks)),  # persistent: per row
                "token_ids": (np.int64, (max_tokens,)),
                "positions": (np.int64, (max_tokens,)),
                "slot_mapping": (np.int64, (max_tokens,)),
                "query_start": (np.int32, (R + 1,)),
                "seq_lens": (np.int32, (R,)),
                "seq_rows": (np.int32, (R,)),
                "logits_rows": (np.int64, (max(max_tokens, R),)),
            },
            self.device,
        )
        if previous is not None:
            self.buffers.host["block_tables"][...] = previous.host["block_tables"]

    # ---- rows -------------------------------------------------------------------------------------

    def _sync_row(self, req: Request) -> int:
        """The request's row, its block table brought up to date with the blocks it holds."""
        row, tables = req.row, self.buffers.host["block_tables"]
        have, need = self._row_blocks[row], len(req.block_ids)
        if need > have:
            tables[row, have:need] = req.block_ids[have:]
            self._row_blocks[row] = need
        return row

    def _admit(self, req: Request) -> None:
        """A request admitted this step (new or resumed) takes its row: an empty table, its sampling state."""
        self._row_blocks[req.row] = 0
        self.sampler.add_row(req.row, req)

    # ---- one step ---------------------------------------------------------------------------------

    def run(self, sched: SchedulerOutput) -> StepResult:
        """One scheduled step: prepare, then execute."""
        return self.execute(self.prepare(sched))

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Fills the step's buffers (and the sampler's) for the scheduled tokens."""
        self.buffers.wait_copied()
        for req in sched.admitted:
            self._admit(req)
        host, drafts = self.buffers.host, sched.drafts
        scheduled = list(sched.num_tokens.items())
        rows, starts, counts, ids, sampling = [], [], [], [], []
        for i, (req, n) in enumerate(scheduled):
            rows.append(self._sync_row(req))
            start = req.num_computed
            starts.append(start)
            counts.append(n)
            if n == 1:
                ids.append(req.token_ids[start])
            elif drafts and req in drafts:  # its last token, then the draft
                ids.append(req.token_ids[start])
                ids += drafts[req]
                n = 1
            else:
                ids += req.token_ids[start : start + n]
            if start + n == req.num_tokens and req.params.max_new_tokens > 0:
                sampling.append(i)
        S, N = len(rows), len(ids)
        if N > self.max_tokens:
            self._allocate(max(N, 2 * self.max_tokens))
            host = self.buffers.host
        host["seq_rows"][:S] = rows
        host["token_ids"][:N] = ids
        positions, seq_lens, query_start = host["positions"][:N], host["seq_lens"][:S], host["query_start"][: S + 1]
        if N == S:  # one token per sequence: decode rows
            positions[:] = starts
            query_start[:] = self._arange[: S + 1]
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
        sample_reqs = [req for req, _ in scheduled] if len(sampling) == S else [scheduled[i][0] for i in sampling]
        t, sample_drafts = self.buffers.tensors, None
        last_rows = query_start[1:][sampling] - 1
        if drafts:  # a drafting request samples its last K + 1 rows
            sample_drafts = [drafts.get(req, []) for req in sample_reqs]
            per = np.fromiter(map(len, sample_drafts), np.int64, len(sample_drafts)) + 1  # (S',) rows each samples
            within = self._arange[: int(per.sum())] - np.repeat(np.cumsum(per) - per, per)  # (R,) 0..K per request
            last_rows = np.repeat(last_rows - per + 1, per) + within  # (R,)
        R = len(last_rows)
        logits_rows = None
        if R and R != N:
            host["logits_rows"][:R] = last_rows
            logits_rows = t["logits_rows"][:R]
        prompt_scoring = plan_prompt_scoring(scheduled, starts, query_start)
        self.buffers.upload()
        batch = StepBatch(
            t["token_ids"],
            t["positions"],
            t["slot_mapping"],
            t["query_start"],
            t["seq_lens"],
            t["block_tables"],
            t["seq_rows"],
            N,
            S,
            max(counts) if S else 0,
            int(seq_lens.max()) if S else 0,
        )
        sampling_args = self.sampler.prepare(sample_reqs, sample_drafts) if R else None
        return StepInputs(batch, sampling_args, logits_rows, prompt_scoring)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepResult:
        hidden = self.model.forward_step(inputs.batch, self.cache)  # (N, C)
        prompt_logprobs = {}
        if inputs.prompt_scoring is not None:
            rows = torch.tensor(inputs.prompt_scoring.rows, device=self.device)  # (P,)
            prompt_logprobs = score_prompts(self.model.compute_logits(hidden[rows]), inputs.prompt_scoring)
        if inputs.sampling is None:
            return StepResult([], prompt_logprobs)
        rows = hidden if inputs.logits_rows is None else hidden[inputs.logits_rows]  # (R, C)
        logits = self.model.compute_logits(rows)  # (R, V) float32
        sampled = self.sampler.sample(logits, inputs.sampling)
        if inputs.sampling.drafts is None:
            return StepResult(sampled, prompt_logprobs)
        return self._verify(sampled, inputs.sampling, prompt_logprobs)

    def _verify(
        self, sampled: list[Sampled], args: SamplingArgs, prompt_logprobs: dict[Request, list[PromptLogprob]]
    ) -> StepResult:
        """Keeps, per drafting request, its target tokens up to the first that differs from the draft
        (that one included): the tokens decoding one at a time would have produced."""
        kept, verified, at = [], {}, 0
        for draft in args.drafts:
            rows = sampled[at : at + len(draft) + 1]  # row j: the target's token after draft[:j]
            at += len(draft) + 1
            if draft:
                req = rows[0].request
                usable = next((j for j, s in enumerate(rows) if s.error is not None), len(draft))
                m = min(accepted_length(draft, [s.token_id for s in rows]), usable)
                for s in rows[:m]:
                    s.cached = True
                rows = rows[: m + 1]
                verified[req] = (len(draft), m)
                if req.params.penalized:
                    self.sampler.commit(req, [s.token_id for s in rows])
            kept += rows
        return StepResult(kept, prompt_logprobs, verified)
