"""KV-cache size and peak memory during serving: `python -m bench.memory [--quick]`.

Reports the bytes one token and one block of KV cache take for the checkpoint's shape and dtype,
the pool the default --kv-cache-memory buys, and for each number of concurrent requests (ascending,
so the last reading is the largest's) the process's peak resident memory (ru_maxrss, which only grows)
and, on CUDA, the peak allocated device memory, after the in-process engine ran them all to the end
of the context.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from bench.common import base_parser, machine_info, resolve, synchronize, write_result
from model.checkpoint import CONFIG_FILE, load_model, load_tokenizer
from model.kv_cache import PagedKVCache
from model.sampling import SamplingParams
from server.engine import Engine, EngineConfig


def peak_rss_bytes() -> int:
    """ru_maxrss is in KiB on Linux, in bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.memory", __doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    model = load_model(args.checkpoint, device=device, dtype=dtype)
    tokenizer = load_tokenizer(args.checkpoint)
    context = model.config.context_length
    batches = sorted(int(b) for b in args.batches.split(","))[: 2 if args.quick else None]
    new_tokens = 8 if args.quick else context - args.prompt_tokens
    rss_after_load = peak_rss_bytes()
    config = EngineConfig(max_num_seqs=max(batches))
    engine = Engine(model, tokenizer, config, threads=args.threads)
    per_block = PagedKVCache.bytes_per_block(model.config, config.block_size, dtype)
    rows = []
    for batch in batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sinks = [[] for _ in range(batch)]
        for i, sink in enumerate(sinks):
            prompt = torch.randint(
                0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(i)
            ).tolist()
            engine.submit(
                prompt,
                SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True),
                sink.append,
                cache_salt=f"{batch}-{i}",
            )
        peak_blocks = 0
        while not all(s and s[-1].finished for s in sinks):
            engine.step()
            peak_blocks = max(peak_blocks, engine.blocks.num_blocks - engine.blocks.num_free_blocks)
        synchronize(device)
        row = {
            "batch": batch,
            "peak_blocks_held": peak_blocks,
            "peak_kv_bytes_held": peak_blocks * per_block,
            "peak_rss_bytes": peak_rss_bytes(),
            "decoded_to_position": args.prompt_tokens + new_tokens,
        }
        if device.type == "cuda":
            row["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        print(
            f"{batch:3d} requests to position {row['decoded_to_position']}: {peak_blocks} blocks held "
            f"({row['peak_kv_bytes_held'] / 2**20:.1f} MiB of KV), peak RSS {row['peak_rss_bytes'] / 2**20:.1f} MiB"
        )
        rows.append(row)
    params = model.num_parameters()
    result = {
        "benchmark": "memory",
        "machine": machine_info(device, dtype),
        "checkpoint": args.checkpoint,
        "model": json.loads((Path(args.checkpoint) / CONFIG_FILE).read_text()),
        "quick": args.quick,
        "parameters": params,
        "parameter_bytes": params * torch.empty((), dtype=model.dtype).element_size(),
        "kv_bytes_per_token": per_block // config.block_size,
        "kv_bytes_per_block": per_block,
        "block_size": config.block_size,
        "kv_cache_bytes": engine.cache.total_bytes(),
        "kv_cache_tokens": engine.blocks.num_blocks * config.block_size,
        "context": context,
        "peak_rss_bytes_after_load": rss_after_load,
        "batches": rows,
    }
    print(
        f"KV cache: {per_block // config.block_size} bytes/token, {per_block / 2**10:.0f} KiB a block of "
        f"{config.block_size}; the pool: {engine.blocks.num_blocks} blocks = "
        f"{engine.blocks.num_blocks * config.block_size} tokens, {engine.cache.total_bytes() / 2**20:.1f} MiB"
    )
    write_result("memory", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
