"""The scheduler under a step budget: chunk sizes, the order prompts are served in, and no starvation.

The scheduler runs alone (no model): a step's update is played by `advance`, and time by a fake clock.
"""

from __future__ import annotations

import httpx
import pytest

from loadtest.server_steps import parse_steps
from model.sampling import SamplingParams
from server.engine.admission import AGEING_S
from server.engine.block_manager import BlockManager
from server.engine.request import Request
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.step_budget import StepBudget, StepCostModel, StepCosts
from tests.server.conftest import serve

# 2 ms a step, 1 ms a decode row, 0.5 ms a prompt token (context costs nothing, to keep the sums short)
COSTS = StepCosts(fixed=0.002, per_decode_row=0.001, per_context_unit=0.0, per_prompt_token=0.0005)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    target_ms: float | None = 20.0, cap: int = 512, max_num_seqs: int = 64, num_blocks: int = 4096
) -> tuple[Scheduler, Clock]:
    model = StepCostModel()
    model.costs = COSTS
    clock = Clock()
    budget = StepBudget(cap, min_prompt_tokens=4, target_s=None if target_ms is None else target_ms / 1000, model=model)
    return Scheduler(
        BlockManager(num_blocks, 16), budget, max_num_seqs=max_num_seqs, max_waiting=1000, clock=clock
    ), clock


def request(sched: Scheduler, clock: Clock, prompt_tokens: int, new_tokens: int = 1000) -> Request:
    req = Request(list(range(1, prompt_tokens + 1)), SamplingParams(max_new_tokens=new_tokens), 0, lambda o: None)
    req.stats.arrival = clock.now
    sched.add_all([req])
    return req


def advance(out: SchedulerOutput) -> None:
    """What the engine's update does to the scheduler's view: tokens computed, one sampled at the end."""
    for req, n in out.num_tokens.items():
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.token_ids.append(7)


def decoding(sched: Scheduler, clock: Clock, rows: int) -> list[Request]:
    """`rows` requests past their prompt, decoding."""
    reqs = [request(sched, clock, 4) for _ in range(rows)]
    while any(r.num_output_tokens == 0 for r in reqs):
        advance(sched.schedule())
    return reqs


def prompt_chunks(out: SchedulerOutput) -> list[int]:
    return [n for req, n in out.num_tokens.items() if n > 1 or req.num_computed < req.num_prompt_tokens - 1]


@pytest.mark.parametrize("target_ms, rows, chunk", [(20, 4, 28), (20, 8, 20), (40, 8, 60), (8, 8, 4)])
def test_the_budget_sizes_the_prompt_chunk_to_the_time_target(target_ms, rows, chunk):
    sched, clock = make_scheduler(target_ms)
    decoding(sched, clock, rows)
    request(sched, clock, 300)
    out = sched.schedule()
    # (target - 2 ms - rows ms) / 0.5 ms a token; at least the floor of 4
    assert prompt_chunks(out) == [chunk]
    assert (out.work.decode_rows, out.work.prompt_tokens) == (rows, chunk)


def test_the_token_cap_bounds_the_chunk_whatever_the_target():
    sched, clock = make_scheduler(1000.0, cap=64)
    decoding(sched, clock, 8)
    request(sched, clock, 300)
    assert prompt_chunks(sched.schedule()) == [64 - 8]


def test_a_step_with_no_decode_rows_takes_the_cap():
    sched, clock = make_scheduler(5.0, cap=200)
    request(sched, clock, 300)
    assert prompt_chunks(sched.schedule()) == [200]


def test_without_a_target_the_token_cap_alone_applies():
    sched, clock = make_scheduler(None, cap=128)
    decoding(sched, clock, 8)
    request(sched, clock, 300)
    assert prompt_chunks(sched.schedule()) == [120]


def test_the_shortest_prompt_goes_first_and_the_long_one_takes_what_is_left():
    sched, clock = make_scheduler(20.0)  # 4 rows: 28 prompt tokens a step
    decoding(sched, clock, 4)
    long_, short = request(sched, clock, 100), request(sched, clock, 10)
    out = sched.schedule()
    assert (out.num_tokens.get(short), out.num_tokens.get(long_)) == (10, 18)
    assert list(out.num_tokens)[-2:] == [short, long_]


def test_an_aged_prompt_goes_before_shorter_ones():
    sched, clock = make_scheduler(20.0)
    decoding(sched, clock, 4)
    long_ = request(sched, clock, 100)
    clock.now += AGEING_S
    short = request(sched, clock, 10)
    out = sched.schedule()
    assert (out.num_tokens.get(long_), out.num_tokens.get(short)) == (28, None)


def test_a_long_prompt_is_served_within_a_bound_under_a_stream_of_short_ones():
    """Short prompts arrive every step, more than the budget serves, forever; the long one, once aged,
    is served first."""
    sched, clock = make_scheduler(20.0)
    decoding(sched, clock, 4)
    long_ = request(sched, clock, 200)
    step_s = 0.02
    for step in range(1000):  # noqa: B007 (read after the loop)
        for _ in range(4):  # 32 prompt tokens a step, against 28 allowed
            request(sched, clock, 8, new_tokens=1)
        out = sched.schedule()
        advance(out)
        for req in [r for r in sched.running if r.num_output_tokens >= r.params.max_new_tokens]:
            sched.finish(req)
        clock.now += step_s
        if long_.num_output_tokens:
            break
    bound = AGEING_S / step_s + 200 / 4 + 2  # aged by then; then at least the floor a step
    assert long_.num_output_tokens == 1, "the long prompt never got its first token"
    assert step < bound, f"the long prompt waited {step} steps (bound {bound:.0f})"


def test_an_aged_request_that_does_not_fit_keeps_its_place_for_the_next_free_one():
    sched, clock = make_scheduler(20.0, max_num_seqs=2)
    first, second = decoding(sched, clock, 2)
    old = request(sched, clock, 12)
    clock.now += AGEING_S
    young = request(sched, clock, 4)
    assert prompt_chunks(sched.schedule()) == []  # no free place
    sched.finish(first)
    out = sched.schedule()
    assert old in out.num_tokens and young not in out.num_tokens


def test_metrics_show_step_histograms_and_the_budget_in_force(tiny_checkpoint):
    server = serve(tiny_checkpoint, max_num_seqs=8, target_step_ms=25.0)
    try:
        with server.client() as client:
            r = client.post("/generate", json={"inputs": "To be or not", "parameters": {"max_new_tokens": 5}})
            assert r.status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=10).text
        steps = server.metric("kvserve:step_duration_seconds_count")
        decode = server.metric("kvserve:step_tokens_sum", kind="decode")
        prompt = server.metric("kvserve:step_tokens_sum", kind="prompt")
        assert steps >= 5, text  # at least this request's 5 steps (warm-up and calibration came before)
        assert decode >= 4 and prompt >= 4  # its 4 decode tokens, its prompt
        assert 'kvserve:step_duration_seconds_bucket{le="+Inf",model_name="tiny"}' in text
        assert server.metric("kvserve:step_budget_target_seconds") == 0.025
        assert server.engine.budget.costs is not None, "warm-up did not calibrate the step costs"
        scraped = parse_steps(text)  # what the load tester reads of it
        assert (scraped.target_step_s, scraped.max_batched_tokens, scraped.steps) == (0.025, 128, steps)
    finally:
        server.stop()
