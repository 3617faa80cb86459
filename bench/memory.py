"""KV-cache size and peak memory during decode: `python -m bench.memory [--quick]`.

Reports KVCache.bytes_per_token / bytes_per_slot for the checkpoint's shape and dtype, and for
each batch size (ascending, so the last reading is the largest batch's) the process's peak
resident memory (ru_maxrss, which only grows) and, on CUDA, the peak allocated device memory,
after prefilling every slot and decoding to the end of the context.
"""
from __future__ import annotations

import resource
import sys

import torch

from bench.common import base_parser, machine_info, resolve, synchronize, write_result
from model.checkpoint import load_model
from model.generate import decode_one_token, prefill
from model.gpt import GPT
from model.kv_cache import KVCache


def peak_rss_bytes() -> int:
    """ru_maxrss is in KiB on Linux, in bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@torch.inference_mode()
def fill_and_decode(model: GPT, batch: int, prompt_tokens: int, new_tokens: int) -> KVCache:
    """A full cache of `batch` slots: prefill, then greedy decode `new_tokens` steps."""
    device, dtype = model.transformer.wte.weight.device, model.transformer.wte.weight.dtype
    cache = KVCache(model.config, batch, dtype=dtype, device=device)
    slots = slice(0, batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), device=device)  # (B, T)
    positions = torch.arange(prompt_tokens, device=device).expand(batch, -1)  # (B, T)
    logits = prefill(model, cache, ids, positions, slots, torch.full((batch,), prompt_tokens - 1, device=device))
    for i in range(new_tokens):
        token = logits.argmax(dim=-1)  # (B,)
        pos = torch.full((batch,), prompt_tokens + i, device=device)  # (B,)
        logits = decode_one_token(model, cache, token, pos, slots, kv_len=prompt_tokens + i + 1)  # (B, V)
    synchronize(device)
    return cache


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.memory", __doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    model = load_model(args.checkpoint, device=device, dtype=dtype)
    context = model.config.n_positions
    batches = sorted(int(b) for b in args.batches.split(","))
    if args.quick:
        batches = batches[:2]
    new_tokens = (8 if args.quick else context - args.prompt_tokens)
    rss_after_load = peak_rss_bytes()
    probe = KVCache(model.config, 1, dtype=dtype, device=device)
    rows = []
    for batch in batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        cache = fill_and_decode(model, batch, args.prompt_tokens, new_tokens)
        row = {"batch": batch, "cache_total_bytes": cache.total_bytes(), "peak_rss_bytes": peak_rss_bytes(),
               "decoded_to_position": args.prompt_tokens + new_tokens}
        if device.type == "cuda":
            row["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        print(f"batch {batch:3d}: cache {row['cache_total_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS {row['peak_rss_bytes'] / 2**20:.1f} MiB")
        rows.append(row)
        del cache
    params = model.num_parameters()
    result = {"benchmark": "memory", "machine": machine_info(device, dtype), "checkpoint": args.checkpoint,
              "model": model.config.to_hf_dict(), "quick": args.quick,
              "parameters": params, "parameter_bytes": params * model.transformer.wte.weight.element_size(),
              "kv_bytes_per_token": probe.bytes_per_token(), "kv_bytes_per_slot": probe.bytes_per_slot(),
              "context": context, "peak_rss_bytes_after_load": rss_after_load, "batches": rows}
    print(f"KV cache: {probe.bytes_per_token()} bytes/token, {probe.bytes_per_slot() / 2**20:.2f} MiB/slot "
          f"({context} + 1 columns)")
    write_result("memory", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
