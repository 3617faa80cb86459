"""How many requests run at once in a given KV memory: `python -m bench.capacity [--quick]`.

The in-process engine with --kv-cache-memory at the previous engine's 32 slots of 512 tokens (128 MiB
for the default model: 16,384 tokens) and room for 128 running requests. Submits 100 requests of
64 prompt tokens and 128 new ones at once (greedy, ignore_eos, each with its own cache salt so no
prefix is shared) and steps the engine to the end, recording how many ran at once, how many blocks
they held, and how many were preempted.
"""

from __future__ import annotations

import time

import torch

from bench.common import base_parser, machine_info, resolve, write_result
from model.checkpoint import load_model, load_tokenizer
from model.sampling import SamplingParams
from model.text import FINISH_LENGTH
from server.engine import Engine, EngineConfig
from server.engine.config import DEFAULT_KV_CACHE_MEMORY


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.capacity", __doc__)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=int, default=DEFAULT_KV_CACHE_MEMORY)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    if args.quick:
        args.requests, args.new_tokens = 12, 8
    model = load_model(args.checkpoint, device=device, dtype=dtype)
    engine = Engine(
        model,
        load_tokenizer(args.checkpoint),
        EngineConfig(max_num_seqs=128, max_waiting=args.requests, kv_cache_memory=args.kv_cache_memory),
        threads=args.threads,
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    sinks = [[] for _ in range(args.requests)]
    for i, sink in enumerate(sinks):
        prompt = torch.randint(
            0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(i)
        ).tolist()
        engine.submit(prompt, params, sink.append, cache_salt=str(i))
    start, steps, peak_running, peak_blocks, running_at = time.perf_counter(), 0, 0, 0, []
    while not all(s and s[-1].finished for s in sinks):
        engine.step()
        steps += 1
        running_at.append(engine.num_running)
        peak_running = max(peak_running, engine.num_running)
        peak_blocks = max(peak_blocks, engine.blocks.num_blocks - engine.blocks.num_free_blocks)
    wall = time.perf_counter() - start
    tokens = sum(len(s) for s in sinks)
    result = {
        "benchmark": "capacity",
        "machine": machine_info(device, dtype),
        "checkpoint": args.checkpoint,
        "quick": args.quick,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_tokens": engine.blocks.num_blocks * engine.blocks.block_size,
        "peak_running": peak_running,
        "peak_blocks_held": peak_blocks,
        "num_blocks": engine.blocks.num_blocks,
        "preemptions": engine.stats.preemptions,
        "steps": steps,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "all_finished_with_length": all(
            s[-1].finish_reason == FINISH_LENGTH and len(s) == args.new_tokens for s in sinks
        ),
        "running_per_step": running_at,
    }
    print(
        f"{args.requests} requests of {args.prompt_tokens} + {args.new_tokens} tokens in "
        f"{result['kv_cache_tokens']} tokens of KV cache: at most {peak_running} ran at once "
        f"({peak_blocks} of {engine.blocks.num_blocks} blocks held), {engine.stats.preemptions} preemptions, "
        f"{steps} steps, {tokens / wall:.0f} tok/s; every request finished whole: {result['all_finished_with_length']}"
    )
    write_result("capacity", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
