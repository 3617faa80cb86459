"""The fallback after a batched step fails: its requests run again one by one, so that only the one
that broke the batch fails and the others go on. A rerun samples what the batch would have: each
draw depends on the request's seed and token index only, and the runner never changes a request."""

from __future__ import annotations

from collections.abc import Callable

from server.engine.model_runner import ModelRunner, StepResult
from server.engine.request import Request
from server.engine.scheduler import SchedulerOutput


def execute_one_by_one(runner: ModelRunner, sched: SchedulerOutput, fail: Callable[[Request, str], None]) -> StepResult:
    """Runs each scheduled request of `sched` alone; `fail(req, error)` ends one whose run raises.
    Returns the merged result of those that ran."""
    merged = StepResult([], {})
    for req, n in sched.num_tokens.items():
        try:
            # admitted again if penalized: its history is rebuilt from its tokens, which the failed run
            # may already have added its pick to
            readmit = req in sched.admitted or req.params.penalized
            result = runner.run(
                SchedulerOutput(
                    num_tokens={req: n},
                    admitted=[req] if readmit else [],
                    drafts={req: sched.drafts[req]} if req in sched.drafts else {},
                )
            )
        except Exception as e:
            fail(req, f"{type(e).__name__}: {e}")
            continue
        merged.sampled += result.sampled
        merged.prompt_logprobs.update(result.prompt_logprobs)
        merged.verified.update(result.verified)
    return merged
