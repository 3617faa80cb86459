"""Prompt logprobs from the prefill's own forward: for the requests that asked, each prompt token's
logprob (and its top alternatives) from the step rows that predict it (position p's logits score
token p + 1). Planned on the host with the step, scored after its forward, in one copy back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.sampling import top_logprobs
from server.engine.request import PromptLogprob, Request


@dataclass
class PromptScoring:
    """The step rows that score prompt tokens this step."""

    rows: list[int]  # the step's token rows whose logits score a prompt token, P of them
    targets: list[int]  # the token each one scores (P,)
    owners: list[tuple[Request, int, int]]  # per request: (it, its first scored position, how many), in row order
    top_k: int  # the most alternatives one of them asks for


def plan_prompt_scoring(
    scheduled: list[tuple[Request, int]], starts: list[int], query_start: np.ndarray
) -> PromptScoring | None:
    """scheduled: (request, new tokens) in step order; starts: each one's first position this step;
    query_start: (S + 1,) each one's first step row. None when no request scores its prompt now."""
    rows, targets, owners = [], [], []
    for i, (req, n) in enumerate(scheduled):
        if req.params.prompt_logprobs is None:
            continue
        start, end = starts[i], min(starts[i] + n, req.num_prompt_tokens - 1)
        if start >= end:
            continue
        first = int(query_start[i])
        rows += range(first, first + end - start)
        targets += req.token_ids[start + 1 : end + 1]
        owners.append((req, start + 1, end - start))  # positions start + 1 .. end are scored
    if not rows:
        return None
    return PromptScoring(rows, targets, owners, max(req.params.prompt_logprobs for req, _, _ in owners))


def score_prompts(logits: torch.Tensor, plan: PromptScoring) -> dict[Request, list[PromptLogprob]]:
    """logits: (P, V) float32 of the plan's rows. Packs (P, 1 + 2k) float64 (the chosen token's logprob,
    then k top ids and k top logprobs), copies it back once and unpacks it per request."""
    k, device = plan.top_k, logits.device
    lse = torch.logsumexp(logits, dim=-1)  # (P,)
    target = torch.tensor(plan.targets, device=device)  # (P,)
    chosen = logits.gather(1, target[:, None])[:, 0] - lse  # (P,)
    columns = [chosen[:, None].double()]
    if k:
        ids, values = top_logprobs(logits, lse, k)  # (P, k)
        columns += [ids.double(), values.double()]
    table = torch.cat(columns, dim=1).tolist()  # (P, 1 + 2k)
    out, at = {}, 0
    for req, first, count in plan.owners:
        want = req.params.prompt_logprobs
        out[req] = [
            PromptLogprob(
                first + j,
                plan.targets[at + j],
                row[0],
                list(zip(map(int, row[1 : 1 + want]), row[1 + k : 1 + k + want])) if want else None,
            )
            for j, row in enumerate(table[at : at + count])
        ]
        at += count
    return out
