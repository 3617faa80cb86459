"""The load tester's reading of a server's step metrics."""

from __future__ import annotations

import pytest

from loadtest.server_steps import StepScrape, parse_steps, steps_between


def test_a_server_without_step_metrics_gives_none_and_dashes():
    assert parse_steps('vllm:num_requests_running{model_name="x"} 0.0\n') is None
    assert set(steps_between(None, None).values()) == {None}


def test_a_run_reports_the_budget_in_force_and_its_steps():
    before = StepScrape(0.04, 128, steps=10, step_seconds=0.5, decode_tokens=100, prompt_tokens=300)
    after = StepScrape(0.04, 128, steps=30, step_seconds=1.3, decode_tokens=500, prompt_tokens=700)
    got = steps_between(before, after)
    assert got == {
        "target_step_ms": 40.0,
        "max_batched_tokens": 128,
        "steps": 20,
        "mean_step_ms": pytest.approx(40.0),
        "decode_tokens_per_step": 20.0,
        "prompt_tokens_per_step": 20.0,
    }


def test_no_target_reads_as_none():
    scrape = StepScrape(0.0, 128, 0, 0.0, 0, 0)
    assert steps_between(scrape, scrape)["target_step_ms"] is None
