"""The engine thread's CPU set-up: torch's thread count, and a priority that lets the threads that stream
tokens run first on an oversubscribed host.

The engine thread (and the kernels' worker threads it starts) is the one CPU-bound thread of a server;
every other thread relays: the event loop that writes a token to its client, and in a cluster the
ingress process that carries each token from a replica to the client. When the cores are all busy (two
replicas and their ingress on two cores, say), the relays wait behind the engine's compute for a
time slice, and each token's latency grows by that wait. Raising the engine thread's nice value by
`niceness` makes the kernel's scheduler run the relays first; the work the engine does is the same.
Linux sets nice values per thread (a thread id is a PRIO_PROCESS target there); elsewhere this is a
no-op. Limits: the step's Python parts hold the GIL, so a relay thread of the same process still waits
for them (the gain is in the kernels' time, which releases it); nice values rank threads within one
scheduling group (a container, an autogroup); and the kernels' pool is one per process, so a second
engine made in the same process (tests) starts its workers again at its own thread's priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch

from model import kernels

log = logging.getLogger("kvserve.engine")

MAX_NICE = 19


def lower_this_thread(niceness: int) -> int | None:
    """Adds `niceness` (>= 0) to the calling thread's nice value, capped at 19. Returns the new value, or
    None where threads cannot be set apart (not Linux) or the change was refused."""
    if niceness <= 0 or sys.platform != "linux":
        return None
    tid = threading.get_native_id()
    try:
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:
        log.warning("could not lower the engine thread's priority: %s", e)
        return None
    return target


def set_up_compute_threads(exact_kernels: bool, torch_threads: int | None, niceness: int, threads: int) -> None:
    """Called first on the engine thread. torch's thread count is process-wide: with the exact kernels,
    torch's few remaining ops (the sampler's) run on one thread, so that its OpenMP workers never spin on
    the cores the kernels' own threads need (BENCHMARKS.md: a batch-32 step took twice as long with both
    pools); else `torch_threads` when set. Then lowers this thread by `niceness` and starts the kernels'
    `threads` workers again from it, so that they inherit its nice value."""
    if exact_kernels:
        torch.set_num_threads(1)
    elif torch_threads:
        torch.set_num_threads(torch_threads)
    if lower_this_thread(niceness) is not None:
        kernels.set_num_threads(threads)


def thread_nice(tid: int) -> int:
    """A thread's nice value (Linux)."""
    return os.getpriority(os.PRIO_PROCESS, tid)
