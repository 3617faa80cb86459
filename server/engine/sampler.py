"""The pick of each step's next tokens: per-row sampling state of the running requests, and one
batched pick for the rows that sample.

Each running request's row holds its parameters (in the step's preallocated buffers), its seed, and,
for a request with penalties, its history: the tokens it has seen (repetition penalty), how often it
generated each (presence and frequency penalties), its logit bias. The pick: the exact greedy kernel
for every row (argmax and normalizer in one pass), then the torch path for the rows that sample or are
penalized, then the top alternatives for the rows that ask. It returns one (R, 3 + 2K) float64 tensor,
the step's one copy back: token, logprob, finite flag, then K top ids and K top logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model import kernels
from model.sampling import Penalties, SamplingBatch, sample, top_logprobs, uniform_draws
from server.engine.request import Request

RESULT_COLUMNS = 3  # token, logprob, finite


@dataclass
class SamplePlan:
    """What the host worked out for one step's pick; the tensors it refers to are in the step buffers."""

    requests: list[Request]  # the rows that sample, in order
    rows: list[int]  # their rows in the step buffers
    num_sampled: int  # of them, the ones that sample (not greedy): their indices are in sampled_idx
    filtered: bool  # some sampled row has top_k or top_p on
    penalized: bool  # some row has a penalty or a logit bias
    top_k: int  # the most top alternatives a row asks for (0: none)


class Sampler:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, exact: bool) -> None:
        self.max_rows, self.vocab_size, self.device, self.exact = max_rows, vocab_size, device, exact
        self.seeds = np.zeros(max_rows, dtype=np.uint64)
        self._seen: torch.Tensor | None = None  # (rows, V) bool, made when a penalized request first arrives
        self._counts: torch.Tensor | None = None  # (rows, V) float32, generated tokens of each row
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> its logit_bias ids, values
        width = RESULT_COLUMNS + 2 * 20
        self._results = torch.zeros((max_rows, width), dtype=torch.float64, device=device)
        self._lse = torch.zeros(max_rows, dtype=torch.float32, device=device)

    # ---- rows -------------------------------------------------------------------------------------

    def add_row(self, row: int, req: Request, host: dict[str, np.ndarray]) -> None:
        """A request's first step: its parameters into its row (and its history, if it is penalized)."""
        p = req.params
        host["temperature"][row] = 1.0 if p.greedy else min(p.temperature, 1e30)  # inf and 1e30: uniform alike
        host["top_k"][row], host["top_p"][row] = p.top_k, p.top_p
        host["repetition_penalty"][row] = p.repetition_penalty
        host["presence_penalty"][row], host["frequency_penalty"][row] = p.presence_penalty, p.frequency_penalty
        self.seeds[row] = req.seed
        self._bias.pop(row, None)
        if not p.penalized:
            return
        if self._seen is None:
            self._seen = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.bool, device=self.device)
            self._counts = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        self._seen[row] = False
        self._seen[row, torch.tensor(req.token_ids, device=self.device)] = True
        self._counts[row] = 0
        if req.num_output_tokens:
            generated = torch.tensor(req.output_ids, device=self.device)
            self._counts[row].index_add_(0, generated, torch.ones(len(generated), device=self.device))
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            self._bias[row] = (torch.tensor(ids, device=self.device), torch.tensor(values, device=self.device))

    # ---- one step ---------------------------------------------------------------------------------

    def plan(self, reqs: list[Request], host: dict[str, np.ndarray]) -> SamplePlan:
        """Host-side work for the pick of rows `reqs` (their rows already in host['sample_rows'])."""
        R = len(reqs)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            host["sampled_idx"][:len(sampled)] = sampled
            indices = np.array([r.num_output_tokens for r in reqs], dtype=np.uint64)
            host["uniform"][:R] = uniform_draws(self.seeds[host["sample_rows"][:R]], indices)
        return SamplePlan(reqs, host["sample_rows"][:R].tolist(), len(sampled),
                          filtered=any(reqs[i].params.top_k > 0 or reqs[i].params.top_p < 1 for i in sampled),
                          penalized=any(r.params.penalized for r in reqs),
                          top_k=max((r.params.logprobs for r in reqs), default=0))

    def sample(self, logits: torch.Tensor, plan: SamplePlan, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """logits: (R, V) float32. Returns the (R, 3 + 2K) float64 results (see the module docstring)."""
        R = logits.shape[0]
        out, lse = self._results[:R, :RESULT_COLUMNS + 2 * plan.top_k], self._lse[:R]
        if self.exact:
            kernels.greedy(logits, self._results[:R], lse)  # every row's argmax and normalizer, in one pass
        else:
            torch.logsumexp(logits, dim=-1, out=lse)  # row-invariant on the CPU (tests/model/test_kernels.py)
            greedy = logits.argmax(dim=-1)  # (R,)
            out[:, 0] = greedy
            out[:, 1] = logits.gather(1, greedy[:, None])[:, 0] - lse
            out[:, 2] = lse.isfinite()
        if plan.num_sampled or plan.penalized:
            self._pick(logits, plan, t, out, lse)
        if plan.top_k:
            k = plan.top_k
            ids, values = top_logprobs(logits, lse, k)  # (R, k) each, from the unmodified distribution
            out[:, RESULT_COLUMNS:RESULT_COLUMNS + k], out[:, RESULT_COLUMNS + k:] = ids, values
        return out

    def _pick(self, logits: torch.Tensor, plan: SamplePlan, t: dict[str, torch.Tensor], out: torch.Tensor,
              lse: torch.Tensor) -> None:
        """The torch path, for a step with sampled or penalized rows: every row's token and logprob."""
        R = logits.shape[0]
        rows = t["sample_rows"][:R]
        penalties = self._penalties(plan, rows, t) if plan.penalized else None
        batch = SamplingBatch(temperature=t["temperature"][rows], top_k=t["top_k"][rows], top_p=t["top_p"][rows],
                              uniform=t["uniform"][:R],
                              sampled_rows=t["sampled_idx"][:plan.num_sampled] if plan.num_sampled else None,
                              filtered=plan.filtered, penalties=penalties)
        broken = out[:, 2] == 0  # (R,): such a row fails its request, not the batch
        logits = logits.masked_fill(broken[:, None], 0.0)
        tokens, logprobs = sample(logits, batch, torch.where(broken, float(np.log(self.vocab_size)), lse))
        out[:, 0], out[:, 1] = tokens, logprobs
        if penalties is not None:  # the sampled tokens join the histories for the next step
            penalized = torch.tensor([r.params.penalized for r in plan.requests], device=self.device)  # (R,)
            self._seen[rows[penalized], tokens[penalized]] = True
            self._counts[rows[penalized], tokens[penalized]] += 1

    def _penalties(self, plan: SamplePlan, rows: torch.Tensor, t: dict[str, torch.Tensor]) -> Penalties:
        bias = None
        if any(r.params.logit_bias for r in plan.requests):
            bias = torch.zeros((len(plan.requests), self.vocab_size), device=self.device)
            for i, row in enumerate(plan.rows):
                if row in self._bias:
                    ids, values = self._bias[row]
                    bias[i].index_add_(0, ids, values)
        return Penalties(t["repetition_penalty"][rows], t["presence_penalty"][rows], t["frequency_penalty"][rows],
                         self._seen[rows], self._counts[rows], bias)
