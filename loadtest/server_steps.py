"""What a kvserve server says of its steps, read from its /metrics before and after a run: the step
budget in force (`--target-step-ms`, `--max-num-batched-tokens`) and the steps the run took. A server
without these metrics (a peer) gives None, and the report shows '-'."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

PREFIX = "kvserve:"


@dataclass(frozen=True)
class StepScrape:
    """The step metrics of one scrape of /metrics."""

    target_step_s: float  # the step time target; 0 when off
    max_batched_tokens: float  # the token cap of a step
    steps: float  # steps so far
    step_seconds: float  # their total wall time
    decode_tokens: float  # decode tokens so far, all steps
    prompt_tokens: float  # prompt tokens so far, all steps


def parse_steps(text: str) -> StepScrape | None:
    """The step metrics of a Prometheus text exposition, or None when it has none."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX + "step_"):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0].removeprefix(PREFIX)
        if 'kind="' in name:
            metric += "." + name.split('kind="', 1)[1].split('"', 1)[0]
        values[metric] = float(value)
    try:
        return StepScrape(
            values["step_budget_target_seconds"],
            values["step_budget_max_batched_tokens"],
            values["step_duration_seconds_count"],
            values["step_duration_seconds_sum"],
            values["step_tokens_sum.decode"],
            values["step_tokens_sum.prompt"],
        )
    except KeyError:
        return None


async def scrape_steps(client: aiohttp.ClientSession, url: str) -> StepScrape | None:
    try:
        async with client.get(f"{url}/metrics") as response:
            if response.status != 200:
                return None
            text = await response.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_steps(text)


def steps_between(before: StepScrape | None, after: StepScrape | None) -> dict:
    """The budget in force during a run and what its steps were, for the report (None where unknown)."""
    if before is None or after is None:
        return {
            "target_step_ms": None,
            "max_batched_tokens": None,
            "steps": None,
            "mean_step_ms": None,
            "decode_tokens_per_step": None,
            "prompt_tokens_per_step": None,
        }
    steps = after.steps - before.steps
    per_step = (lambda total: total / steps) if steps else (lambda total: None)
    mean = per_step(after.step_seconds - before.step_seconds)
    return {
        "target_step_ms": after.target_step_s * 1e3 if after.target_step_s else None,
        "max_batched_tokens": int(after.max_batched_tokens),
        "steps": int(steps),
        "mean_step_ms": None if mean is None else mean * 1e3,
        "decode_tokens_per_step": per_step(after.decode_tokens - before.decode_tokens),
        "prompt_tokens_per_step": per_step(after.prompt_tokens - before.prompt_tokens),
    }
