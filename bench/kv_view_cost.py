"""What watching the KV cache costs the engine: `python -m bench.kv_view_cost [--quick]`.

The same batch of requests (submitted at once, greedy, ignore_eos) runs in turns unwatched and watched.
Watched means what one `GET /kv/stream` loop does (server/api/kv_routes.py): a snapshot taken on the
engine thread between two steps every KV_STREAM_PERIOD seconds, turned into JSON off the engine thread.
Reported: the batch's wall time both ways (medians, in turns), and the time each snapshot held the
engine thread and its JSON size, on the default pool.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time

import torch

from bench.common import base_parser, interleaved_medians, machine_info, resolve, write_result
from model.checkpoint import load_tokenizer
from model.sampling import SamplingParams
from server.api.kv_routes import KV_STREAM_PERIOD
from server.engine import Engine, EngineArgs, EngineConfig
from server.engine.kv_view import kv_snapshot

PROMPT = "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n"


class Watcher:
    """A thread doing what the stream's loop does, recording each snapshot's time on the engine thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.held_s: list[float] = []  # per snapshot: seconds it held the engine thread
        self.json_bytes: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _snapshot(self):
        start = time.perf_counter()
        snapshot = kv_snapshot(self.engine.blocks, self.engine.scheduler)
        self.held_s.append(time.perf_counter() - start)
        return snapshot

    def _run(self) -> None:
        while not self.stop.is_set():
            snapshot = self.engine.run_between_steps(self._snapshot).result()
            self.json_bytes.append(len(json.dumps(dataclasses.asdict(snapshot), separators=(",", ":"))))
            self.stop.wait(KV_STREAM_PERIOD)


def main() -> None:
    ap = base_parser("bench.kv_view_cost", __doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.repeats = 4, 16, 1
    device, dtype = resolve(args)
    engine = Engine.from_args(
        EngineArgs(
            checkpoint=args.checkpoint, device=str(device), dtype=args.dtype, config=EngineConfig(threads=args.threads)
        )
    ).start()
    engine.warmup()
    prompt = load_tokenizer(args.checkpoint).encode(PROMPT)
    watchers: list[Watcher] = []

    def batch() -> None:
        done = threading.Semaphore(0)
        for i in range(args.requests):
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            engine.submit(prompt, params, lambda out: out.finished and done.release(), cache_salt=f"run-{i}")
        for _ in range(args.requests):
            done.acquire()

    def watched() -> None:
        watcher = Watcher(engine)
        watchers.append(watcher)
        watcher.thread.start()
        try:
            batch()
        finally:
            watcher.stop.set()
            watcher.thread.join()

    times = interleaved_medians({"unwatched": batch, "watched": watched}, torch.device("cpu"), args.repeats)
    held = [s for w in watchers for s in w.held_s]
    sizes = [n for w in watchers for n in w.json_bytes]
    result = {
        "machine": machine_info(device, dtype),
        "pool_blocks": engine.blocks.num_blocks,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "batch_s": times,
        "watched_over_unwatched": times["watched"]["median_s"] / times["unwatched"]["median_s"],
        "snapshots": len(held),
        "snapshot_held_engine_ms": {"median": 1e3 * statistics.median(held), "max": 1e3 * max(held)},
        "snapshot_json_bytes": {"median": statistics.median(sizes), "max": max(sizes)},
    }
    engine.shutdown()
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_result("kv_view_cost", result, args.out)


if __name__ == "__main__":
    main()
