"""The kernels' idle spin, set step by step from the recent step times (synthetic times, then one engine)."""

from __future__ import annotations

import pytest

from model import kernels
from model.sampling import SamplingParams
from server.engine import Engine
from server.engine.kernel_spin import KernelSpin

pytestmark = pytest.mark.skipif(kernels.spin_us() is None, reason="the kernels' library is not built here")


@pytest.fixture(autouse=True)
def restore_spin():
    yield
    kernels.set_spin_us(kernels.configured_spin_us())


def test_a_lone_sequence_in_short_steps_lets_idle_threads_sleep():
    spin = KernelSpin(long_step_spin_us=77, short_step_s=0.005)
    spin.observe(0.001, sequences=1)
    assert kernels.spin_us() == 0
    spin.observe(0.001, sequences=2)  # a batch spins, however short its steps
    assert kernels.spin_us() == 77
    spin.observe(0.001, sequences=1)
    assert kernels.spin_us() == 0
    for _ in range(20):
        spin.observe(0.050, sequences=1)  # a lone sequence in long steps spins
    assert kernels.spin_us() == 77
    spin.observe(0.001, sequences=1)  # one short step among long ones leaves the recent average long
    assert kernels.spin_us() == 77
    for _ in range(20):
        spin.observe(0.001, sequences=1)
    assert kernels.spin_us() == 0


def test_the_engine_sets_the_spin_from_its_own_steps(tiny_model, tiny_tokenizer):
    kernels.set_spin_us(12345)
    eng = Engine(tiny_model, tiny_tokenizer, threads=1)  # not started: stepped here
    events = []
    eng.submit(tiny_tokenizer.encode("To be"), SamplingParams(max_new_tokens=4, temperature=0), events.append)
    while not (events and events[-1].finished):
        eng.step()
    spin = eng.kernel_spin
    assert spin.recent_s is not None
    assert kernels.spin_us() == (0 if spin.recent_s < spin.short_step_s else spin.spin_us)  # one sequence
