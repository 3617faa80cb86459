"""The engine thread's niceness: set on the compute threads only, so the threads that stream run first."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from model import kernels
from model.sampling import SamplingParams
from server.cli import CLUSTER_ENGINE_NICENESS, engine_config_from, parse_args, parse_cluster_args
from server.engine import Engine
from server.engine.thread_priority import thread_nice

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice values are per thread on Linux only")


def nice_of_threads() -> dict[int, int]:
    return {int(tid): thread_nice(int(tid)) for tid in os.listdir("/proc/self/task")}


def test_the_engine_lowers_its_compute_threads_and_no_other(tiny_model, tiny_tokenizer):
    base = thread_nice(threading.get_native_id())
    before_nice = nice_of_threads()
    before = set(before_nice)
    eng = Engine(tiny_model, tiny_tokenizer, threads=2, engine_niceness=3).start()
    try:
        done = threading.Event()
        eng.submit(
            tiny_tokenizer.encode("To be"),
            SamplingParams(max_new_tokens=4, temperature=0),
            lambda out: out.finished and done.set(),
        )
        assert done.wait(60)
        nice = nice_of_threads()
        assert nice[eng._thread.native_id] == min(19, base + 3)
        assert thread_nice(threading.get_native_id()) == base, "the calling thread keeps its priority"
        lowered = {tid for tid, n in nice.items() if n == min(19, base + 3)}
        assert kernels.num_threads() == 2 or kernels.spin_us() is None
        if kernels.num_threads() == 2:  # the kernels' worker, started again from the engine thread
            assert len(lowered - before) >= 2, nice
        changed = {tid: (before_nice[tid], n) for tid, n in nice.items() if tid in before and n != before_nice[tid]}
        assert not changed, f"threads that were running before the engine changed priority: {changed}"
    finally:
        eng.shutdown(timeout=10)


def test_niceness_is_unchanged_by_default_and_four_on_cluster_replicas():
    assert engine_config_from(parse_args(["--checkpoint", "x"])).engine_niceness == 0
    assert engine_config_from(parse_args(["--checkpoint", "x", "--engine-niceness", "2"])).engine_niceness == 2
    args = parse_cluster_args(["--checkpoint", "x"])
    assert engine_config_from(args).engine_niceness == CLUSTER_ENGINE_NICENESS == 4
    assert engine_config_from(parse_cluster_args(["--checkpoint", "x", "--engine-niceness", "0"])).engine_niceness == 0
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "x", "--engine-niceness", "20"])
