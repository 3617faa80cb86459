"""The pick of each step's next tokens: the running requests' per-row sampling state, and one batched
pick for the rows that sample.

The sampler owns its buffers. Each running request's row holds its parameters, its seed and, for a
request with penalties, its history: the tokens it has seen (repetition penalty), how often it
generated each (presence and frequency penalties), its logit bias. `prepare` writes a step's draws
and hands back one `SamplingArgs`; `sample` makes the pick: the exact greedy kernel for every row
(argmax and normalizer in one pass), then the torch path for the rows that sample or are penalized,
then the top alternatives for the rows that ask. The pick is packed into one (R, 3 + 2K) float64
tensor, the step's one copy back, and unpacked below it into `Sampled` rows.

Structured output: `prepare` hands the bitmask of every row whose request has a grammar (model/grammar.py), the
rows of its speculative draft included, to the sampler's mask thread, which fills them while the step's forward
runs (llguidance drops the GIL while it computes a mask; the matchers stay still until the pick has waited for
it), and the pick keeps each such row to the tokens its grammar allows: in a step of greedy rows, through the
exact kernels' pick over the bitmask itself (one pass a row); otherwise through torch, the mask unpacked to a
(c, V) bool. The two pick the same token with the same logprob. The matchers follow the tokens kept in the
engine's update.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from model import kernels
from model.grammar import bitmask_words, fill_bitmasks, forbidden_tokens
from model.sampling import MAX_LOGPROBS, Penalties, SamplingBatch, sample, top_logprobs, uniform_draws
from server.engine.input_buffers import InputBuffers
from server.engine.request import Request

RESULT_COLUMNS = 3  # token, logprob, finite; then K top ids and K top logprobs
NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


@dataclass
class SamplingArgs:
    """One step's pick as `Sampler.prepare` planned it; the tensors are views of the sampler's buffers."""

    requests: list[Request]  # the request of each of the R rows that sample, in order
    rows: torch.Tensor  # (R,) int64, each one's row in the per-row state
    uniform: torch.Tensor  # (R,) float64, each one's draw for the token it samples now
    sampled_idx: torch.Tensor | None  # (s,) int64, which of the R sample (not greedy); None: all greedy
    filtered: bool  # some sampled row has top_k or top_p on
    penalized: bool  # some row has a penalty or a logit bias
    top_k: int  # the most top alternatives a row asks for (0: none)
    drafts: list[list[int]] | None = None  # per request (in order, once each), the draft it verifies; None: none
    draft_history: list[tuple[int, list[int]]] | None = None  # (row i, draft tokens before it) of penalized drafts
    keeps_history: list[bool] | None = None  # (R,) rows whose pick joins their history now; None: the penalized
    masked_rows: torch.Tensor | None = None  # (c,) int64 rows a grammar restricts, ascending; None: none is
    bitmask: np.ndarray | None = None  # (c, words) int32, the tokens each of those rows may pick (bit per token)
    grammar_errors: dict[int, str] | None = None  # row -> why its request's grammar cannot go on (it fails)
    pending_masks: Future | None = None  # the mask thread's (bitmask, grammar_errors), until `wait_masks`

    def wait_masks(self) -> None:
        """Takes the masks from the mask thread, once they are filled (its error, if the fill raised)."""
        if self.pending_masks is not None:
            pending, self.pending_masks = self.pending_masks, None
            self.bitmask, self.grammar_errors = pending.result()


@dataclass
class Sampled:
    request: Request  # the request this token belongs to
    token_id: int  # the token sampled for it
    logprob: float  # its log-probability under the model's unmodified distribution
    cached: bool = False  # an accepted draft token: its keys and values are in the cache already
    error: str | None = None  # set when this row's logits were unusable (NaN, inf): the token means nothing
    top: list[tuple[int, float]] | None = None  # the most likely tokens and their logprobs, when asked for


@dataclass
class MaskStats:
    """Running totals of the grammar masks, read by /metrics."""

    rows: int = 0  # rows whose pick a grammar restricted (a draft's rows included)
    seconds: float = 0.0  # time spent filling those masks and unpacking them


class Sampler:
    def __init__(
        self, max_rows: int, vocab_size: int, device: torch.device, exact: bool, max_samples: int | None = None
    ) -> None:
        """max_rows: requests running at once; max_samples: rows a step samples, at most (drafts verify
        several per request; default max_rows)."""
        self.max_rows, self.vocab_size, self.device, self.exact = max_rows, vocab_size, device, exact
        R, M = max_rows, max(max_samples or max_rows, max_rows)
        self.buffers = InputBuffers(
            {
                "temperature": (np.float32, (R,)),
                "top_k": (np.int64, (R,)),
                "top_p": (np.float32, (R,)),  # per row
                "repetition_penalty": (np.float32, (R,)),
                "presence_penalty": (np.float32, (R,)),
                "frequency_penalty": (np.float32, (R,)),
                "sample_rows": (np.int64, (M,)),
                "uniform": (np.float64, (M,)),
                "sampled_idx": (np.int64, (M,)),  # per step
            },
            device,
        )
        self.seeds = np.zeros(R, dtype=np.uint64)
        self._seen: torch.Tensor | None = None  # (rows, V) bool, made when a penalized request first arrives
        self._counts: torch.Tensor | None = None  # (rows, V) float32, generated tokens of each row
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> its logit_bias ids, values
        self._results = torch.zeros((M, RESULT_COLUMNS + 2 * MAX_LOGPROBS), dtype=torch.float64, device=device)
        self._lse = torch.zeros(M, dtype=torch.float32, device=device)
        self._bitmask = np.full((M, bitmask_words(vocab_size)), -1, dtype=np.int32)  # grammar rows' allowed tokens
        self._mask_thread: ThreadPoolExecutor | None = None  # made at the first step with a grammar
        self.mask_stats = MaskStats()

    # ---- rows -------------------------------------------------------------------------------------

    def add_row(self, row: int, req: Request) -> None:
        """A request admitted into `row`: its parameters (and its history, if it is penalized)."""
        p, host = req.params, self.buffers.host
        self.buffers.wait_copied()
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

    def prepare(self, reqs: list[Request], drafts: list[list[int]] | None = None) -> SamplingArgs:
        """The host-side work of a pick for `reqs` (each holding its row): draws, rows, flags. With
        `drafts` (one per request), a request with a K-token draft samples K + 1 rows: row j picks
        the token decoding would pick after draft[:j] (its draw is for token index n + j, its penalties
        count draft[:j] as generated). The buffers go to the device only when the torch path will read
        them (a sampled or penalized row)."""
        self.buffers.wait_copied()
        host, t = self.buffers.host, self.buffers.tensors
        masks = self._masks(reqs, drafts) if any(r.grammar is not None for r in reqs) else (None, None)
        offsets = row_drafts = None
        if drafts is not None:
            offsets = [j for d in drafts for j in range(len(d) + 1)]  # (R,) each row's place in its draft
            row_drafts = [d for d in drafts for _ in range(len(d) + 1)]  # (R,) each row's request's draft
            reqs = [r for r, d in zip(reqs, drafts) for _ in range(len(d) + 1)]
        R = len(reqs)
        host["sample_rows"][:R] = [r.row for r in reqs]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            host["sampled_idx"][: len(sampled)] = sampled
            indices = np.array([r.num_output_tokens for r in reqs], dtype=np.uint64)
            if offsets is not None:
                indices += np.array(offsets, dtype=np.uint64)
            host["uniform"][:R] = uniform_draws(self.seeds[host["sample_rows"][:R]], indices)
        penalized = any(r.params.penalized for r in reqs)
        history = keeps = None
        if penalized and offsets is not None:
            keeps = [r.params.penalized and not d for r, d in zip(reqs, row_drafts)]
            history = [
                (i, d[:j]) for i, (r, j, d) in enumerate(zip(reqs, offsets, row_drafts)) if r.params.penalized and j
            ]
        if sampled or penalized or masks[0] is not None:
            self.buffers.upload()
        return SamplingArgs(
            reqs,
            t["sample_rows"][:R],
            t["uniform"][:R],
            t["sampled_idx"][: len(sampled)] if sampled else None,
            filtered=any(reqs[i].params.top_k > 0 or reqs[i].params.top_p < 1 for i in sampled),
            penalized=penalized,
            top_k=max((r.params.logprobs for r in reqs), default=0),
            drafts=drafts,
            draft_history=history,
            keeps_history=keeps,
            masked_rows=masks[0],
            pending_masks=masks[1],
        )

    def _masks(self, reqs: list[Request], drafts: list[list[int]] | None) -> tuple[torch.Tensor, Future]:
        """The grammar rows of a step: their indices among its R rows (c,), and the mask thread's work on them:
        the tokens each may pick (c, words) and the rows whose grammar failed (they may pick anything; their
        request fails)."""
        entries, rows, at = [], [], 0
        for k, req in enumerate(reqs):
            draft = drafts[k] if drafts is not None else []
            if req.grammar is not None:
                entries.append((req.grammar, at, draft))
                rows += range(at, at + len(draft) + 1)
            at += len(draft) + 1
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        return torch.tensor(rows, device=self.device), self._mask_thread.submit(self._fill_masks, entries, rows)

    def _fill_masks(self, entries: list, rows: list[int]) -> tuple[np.ndarray, dict[int, str] | None]:
        began = time.perf_counter()
        fill_bitmasks(entries, self._bitmask)
        errors = {}
        for matcher, first, draft in entries:
            if matcher.error is not None:
                self._bitmask[first : first + len(draft) + 1] = -1
                errors.update({r: f"its grammar failed: {matcher.error}" for r in range(first, first + len(draft) + 1)})
        self.mask_stats.rows += len(rows)
        self.mask_stats.seconds += time.perf_counter() - began
        return self._bitmask[rows], errors or None

    def commit(self, req: Request, tokens: list[int]) -> None:
        """A drafting penalized request's accepted tokens join its history (a pick of draft rows leaves
        the histories alone: which rows count is known only after verification)."""
        ids = torch.tensor(tokens, device=self.device)
        self._seen[req.row, ids] = True
        self._counts[req.row].index_add_(0, ids, torch.ones(len(tokens), device=self.device))

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> list[Sampled]:
        """logits: (R, V) float32. The pick of every row, copied back once and unpacked."""
        return self.unpack(self.pick(logits, args), args)

    def pick(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """logits: (R, V) float32. Returns the packed (R, 3 + 2K) float64 results: token, logprob, finite
        flag, then K top ids and K top logprobs (K = args.top_k)."""
        R = logits.shape[0]
        args.wait_masks()
        out, lse = self._results[:R, : RESULT_COLUMNS + 2 * args.top_k], self._lse[:R]
        if self.exact:
            kernels.greedy(logits, self._results[:R], lse)  # every row's argmax and normalizer, in one pass
        else:
            torch.logsumexp(logits, dim=-1, out=lse)  # row-invariant on the CPU (tests/model/test_kernels.py)
            greedy = logits.argmax(dim=-1)  # (R,)
            out[:, 0] = greedy
            out[:, 1] = logits.gather(1, greedy[:, None])[:, 0] - lse
            out[:, 2] = lse.isfinite()
        if args.sampled_idx is not None or args.penalized or (args.masked_rows is not None and not self.exact):
            self._pick_torch(logits, args, out, lse)
        elif args.masked_rows is not None:  # greedy rows a grammar holds: the greedy pick among the allowed tokens
            kernels.greedy_masked(logits, args.masked_rows, torch.from_numpy(args.bitmask), out, lse)
        if args.top_k:
            k = args.top_k
            ids, values = top_logprobs(logits, lse, k)  # (R, k) each, from the unmodified distribution
            out[:, RESULT_COLUMNS : RESULT_COLUMNS + k], out[:, RESULT_COLUMNS + k :] = ids, values
        return out

    @staticmethod
    def unpack(results: torch.Tensor, args: SamplingArgs) -> list[Sampled]:
        """The packed (R, 3 + 2K) results as one Sampled per row: the step's one device-to-host copy."""
        k, sampled, failed = args.top_k, [], args.grammar_errors or {}
        for i, (req, row) in enumerate(zip(args.requests, results.tolist())):
            want = req.params.logprobs
            top = list(zip(map(int, row[RESULT_COLUMNS : RESULT_COLUMNS + want]), row[RESULT_COLUMNS + k :][:want]))
            error = failed.get(i) if row[2] else NON_FINITE
            sampled.append(Sampled(req, int(row[0]), row[1], error=error, top=top if want else None))
        return sampled

    def _pick_torch(self, logits: torch.Tensor, args: SamplingArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The torch path, for a step with sampled or penalized rows: every row's token and logprob."""
        t, rows = self.buffers.tensors, args.rows
        penalties = self._penalties(args) if args.penalized else None
        forbidden = None
        if args.masked_rows is not None:  # the grammar rows' forbidden tokens as a (c, V) bool mask
            began = time.perf_counter()
            forbidden = forbidden_tokens(args.bitmask, self.vocab_size).to(self.device)
            self.mask_stats.seconds += time.perf_counter() - began
        batch = SamplingBatch(
            temperature=t["temperature"][rows],
            top_k=t["top_k"][rows],
            top_p=t["top_p"][rows],
            uniform=args.uniform,
            sampled_rows=args.sampled_idx,
            filtered=args.filtered,
            penalties=penalties,
            masked_rows=args.masked_rows,
            forbidden=forbidden,
        )
        broken = out[:, 2] == 0  # (R,): such a row fails its request, not the batch
        logits = logits.masked_fill(broken[:, None], 0.0)
        tokens, logprobs = sample(logits, batch, torch.where(broken, float(np.log(self.vocab_size)), lse))
        out[:, 0], out[:, 1] = tokens, logprobs
        if penalties is not None:  # the sampled tokens join the histories for the next step
            keeps = args.keeps_history or [r.params.penalized for r in args.requests]
            penalized = torch.tensor(keeps, device=self.device)  # (R,)
            self._seen[rows[penalized], tokens[penalized]] = True
            self._counts[rows[penalized], tokens[penalized]] += 1

    def _penalties(self, args: SamplingArgs) -> Penalties:
        t, rows, bias = self.buffers.tensors, args.rows, None
        if any(r.params.logit_bias for r in args.requests):
            bias = torch.zeros((len(args.requests), self.vocab_size), device=self.device)
            for i, req in enumerate(args.requests):
                if req.row in self._bias:
                    ids, values = self._bias[req.row]
                    bias[i].index_add_(0, ids, values)
        seen, counts = self._seen[rows], self._counts[rows]  # (R, V) copies
        for i, before in args.draft_history or ():  # a draft row: the draft tokens before it count as generated
            ids = torch.tensor(before, device=self.device)
            seen[i, ids] = True
            counts[i].index_add_(0, ids, torch.ones(len(before), device=self.device))
        return Penalties(
            t["repetition_penalty"][rows], t["presence_penalty"][rows], t["frequency_penalty"][rows], seen, counts, bias
        )
