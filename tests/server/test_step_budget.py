"""The step budget: the cost model it fits, and the prompt tokens it allows (synthetic timings only)."""

from __future__ import annotations

import pytest

from server.engine.step_budget import CONTEXT_UNIT, StepBudget, StepCostModel, StepCosts, StepWork

TRUE = StepCosts(fixed=0.002, per_decode_row=0.001, per_context_unit=0.004, per_prompt_token=0.0005)


def varied_steps(n: int = 64) -> list[StepWork]:
    """Decode-only, prompt-only and mixed steps of many sizes, as a server sees them."""
    steps = []
    for i in range(n):
        rows = i % 9
        steps.append(StepWork(rows, rows * (64 + 37 * (i % 5)), (i * 13) % 97 if i % 3 else 0))
    return steps


def trained(costs: StepCosts = TRUE, **kw) -> StepCostModel:
    model = StepCostModel(**kw)
    for work in varied_steps():
        model.observe(work, costs.seconds(work))
    model.fit()
    return model


def test_the_cost_model_recovers_linear_costs():
    costs = trained().costs
    for name in ("fixed", "per_decode_row", "per_context_unit", "per_prompt_token"):
        assert getattr(costs, name) == pytest.approx(getattr(TRUE, name), rel=0.02), name


def test_a_kind_of_work_missing_from_the_window_keeps_its_last_cost():
    model = trained(window=32, refit_every=1)
    for _ in range(64):  # decode only, for longer than the window
        work = StepWork(8, 8 * 200, 0)
        model.observe(work, TRUE.seconds(work))
    assert model.costs.per_prompt_token == pytest.approx(TRUE.per_prompt_token, rel=0.05)


def test_the_costs_follow_a_slower_machine():
    slower = StepCosts(*(2 * v for v in TRUE.vector()))
    model = trained()
    for work in varied_steps() * 5:
        model.observe(work, slower.seconds(work))
    assert model.costs.per_prompt_token == pytest.approx(slower.per_prompt_token, rel=0.05)


def budget(target_ms: float | None, cap: int = 512, floor: int = 4) -> StepBudget:
    """A budget whose model holds the true costs (the fit is tested above)."""
    model = StepCostModel()
    model.costs = TRUE
    return StepBudget(cap, floor, None if target_ms is None else target_ms / 1000, model=model)


def test_the_budget_sizes_prompt_chunks_to_the_target():
    # 8 rows reading 1024 tokens: 2 + 8 + 4 = 14 ms; 20 ms leaves 6 ms, 12 tokens at 0.5 ms
    assert budget(20).prompt_tokens(8, CONTEXT_UNIT) == 12
    assert budget(40).prompt_tokens(8, CONTEXT_UNIT) == 52
    assert budget(40).prompt_tokens(2, CONTEXT_UNIT // 4) == (40 - 2 - 2 - 1) * 2


def test_the_token_cap_stays_a_hard_cap():
    assert budget(10_000, cap=128).prompt_tokens(8, CONTEXT_UNIT) == 120


def test_prompts_get_the_floor_when_decode_rows_alone_exceed_the_target():
    assert budget(5, floor=4).prompt_tokens(8, CONTEXT_UNIT) == 4


def test_a_step_without_decode_rows_takes_the_cap():
    assert budget(5, cap=256).prompt_tokens(0, 0) == 256


def test_without_a_target_or_a_fit_the_cap_applies():
    assert budget(None, cap=128).prompt_tokens(8, CONTEXT_UNIT) == 120
    cold = StepBudget(128, 4, 0.005)
    assert cold.costs is None and cold.prompt_tokens(8, CONTEXT_UNIT) == 120


def test_the_allowance_shrinks_when_steps_turn_out_slower():
    b = budget(40)
    before = b.prompt_tokens(8, CONTEXT_UNIT)
    slower = StepCosts(*(2 * v for v in TRUE.vector()))
    for work in varied_steps() * 5:
        b.observe(work, slower.seconds(work))
    # (40 - 28) ms at 1 ms a token
    assert (before, b.prompt_tokens(8, CONTEXT_UNIT)) == (52, 12)
    assert b.last_allowance == 12
