"""Cached vs uncached decoding, offline: `python -m bench.cache_speedup [--quick]`.

Per-token decode latency at several context lengths (batch 1 and 8): the cached step feeds one
token and reads the rest from the KV cache; the uncached step recomputes the whole sequence (the
engine's `use_cache: false`). Then the total time to generate from a 32-token prompt, both ways,
greedy. Timings are taken in turns (cached, uncached, cached, ...) in the same run; medians of the
repeats are reported, with the largest |cached - uncached| logit difference (0 with the exact kernels).
"""

from __future__ import annotations

import torch

from bench.common import (
    base_parser,
    interleaved_medians,
    kernel_sets,
    machine_info,
    resolve,
    stock_threads,
    write_result,
)
from model.checkpoint import load_model
from model.description import InferenceModel
from model.generate import decode_one_token, prefill, recompute, sequence_cache
from model.kv_cache import PagedKVCache, StepBatch

PROMPT_TOKENS = 32
BLOCK_SIZE = 16


def decode_step_latency(model: InferenceModel, context: int, batch: int, repeats: int) -> dict:
    """One new token at position context - 1 for each of `batch` sequences, cached and recomputed."""
    gen = torch.Generator().manual_seed(context * 100 + batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).tolist()
    per_seq = -(-context // BLOCK_SIZE)
    cache = PagedKVCache(model.config, batch * per_seq, BLOCK_SIZE, dtype=model.dtype, device=model.device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    device = model.device
    model.forward_step(StepBatch.build([(s[:-1], 0, t) for s, t in zip(ids, tables)], BLOCK_SIZE, device), cache)
    cached_step = StepBatch.build([(s[-1:], context - 1, t) for s, t in zip(ids, tables)], BLOCK_SIZE, device)
    scratch = PagedKVCache(model.config, batch * per_seq, BLOCK_SIZE, dtype=model.dtype, device=device)
    uncached_step = StepBatch.build([(s, 0, t) for s, t in zip(ids, tables)], BLOCK_SIZE, device)
    last = uncached_step.query_start[1:].long() - 1

    def cached():  # rewrites the same slot each time: the same work every repeat
        return model.compute_logits(model.forward_step(cached_step, cache))  # (B, V)

    def uncached():
        return model.compute_logits(model.forward_step(uncached_step, scratch)[last])  # (B, V)

    diff = (cached() - uncached()).abs().max().item()
    times = interleaved_medians({"cached": cached, "uncached": uncached}, device, repeats, warmup=2)
    ms = {name: t["median_s"] * 1e3 for name, t in times.items()}
    return {
        "context": context,
        "batch": batch,
        "cached_ms": ms["cached"],
        "uncached_ms": ms["uncached"],
        "uncached_over_cached": ms["uncached"] / ms["cached"],
        "max_abs_logit_diff": diff,
        "samples_s": times,
    }


def generate_cached(model: InferenceModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy, batch 1: prefill the prompt, then one cached step per token."""
    cache, blocks = sequence_cache(model, len(prompt) + new_tokens)
    logits, out = prefill(model, cache, prompt, blocks), []
    for i in range(new_tokens):
        out.append(int(logits.argmax()))
        if i < new_tokens - 1:
            logits = decode_one_token(model, cache, out[-1], len(prompt) + i, blocks)
    return out


def generate_uncached(model: InferenceModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy, batch 1: the whole growing sequence through the model for every token."""
    cache, blocks = sequence_cache(model, len(prompt) + new_tokens)
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(recompute(model, cache, ids, blocks).argmax()))
    return ids[len(prompt) :]


def generation_total(model: InferenceModel, new_tokens: int, repeats: int) -> dict:
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    same = generate_cached(model, prompt, new_tokens) == generate_uncached(model, prompt, new_tokens)
    fns = {
        "cached": lambda: generate_cached(model, prompt, new_tokens),
        "uncached": lambda: generate_uncached(model, prompt, new_tokens),
    }
    times = interleaved_medians(fns, model.device, repeats, warmup=1)
    cached_s, uncached_s = times["cached"]["median_s"], times["uncached"]["median_s"]
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "batch": 1,
        "cached_s": cached_s,
        "uncached_s": uncached_s,
        "cached_tokens_per_s": new_tokens / cached_s,
        "uncached_tokens_per_s": new_tokens / uncached_s,
        "uncached_over_cached": uncached_s / cached_s,
        "same_greedy_tokens": same,
        "samples_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.cache_speedup", __doc__)
    ap.add_argument("--contexts", default="64,128,256,512", help="context lengths (capped at the model's)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=None, help="default 20 (3 with --quick)")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    results = {}
    for name in kernel_sets(args, device, dtype):
        model = load_model(args.checkpoint, device=device, dtype=dtype, kernels=name)
        limit = model.config.context_length
        contexts = sorted({min(int(c), limit) for c in args.contexts.split(",")})[: 2 if args.quick else None]
        repeats = args.repeats or (3 if args.quick else 20)
        new_tokens = min(32, limit - PROMPT_TOKENS) if args.quick else min(512, limit) - PROMPT_TOKENS
        steps = []
        with stock_threads(name):
            for batch in (int(b) for b in args.batches.split(",")):
                for context in contexts:
                    row = decode_step_latency(model, context, batch, repeats)
                    print(
                        f"{name}: batch {batch:2d} context {context:4d}: cached {row['cached_ms']:.2f} ms, "
                        f"uncached {row['uncached_ms']:.2f} ms, uncached/cached {row['uncached_over_cached']:.1f}x, "
                        f"max |diff| {row['max_abs_logit_diff']:.2g}",
                        flush=True,
                    )
                    steps.append(row)
            total = generation_total(model, new_tokens, max(1, repeats // 4) if not args.quick else 1)
        print(
            f"{name}: generate {new_tokens} tokens from {PROMPT_TOKENS}: cached {total['cached_s']:.2f} s, "
            f"uncached {total['uncached_s']:.2f} s, uncached/cached {total['uncached_over_cached']:.1f}x, "
            f"same greedy tokens: {total['same_greedy_tokens']}",
            flush=True,
        )
        results[name] = {"decode_step": steps, "generation": total}
    write_result(
        "cache_speedup",
        {
            "benchmark": "cache_speedup",
            "machine": machine_info(device, dtype),
            "checkpoint": args.checkpoint,
            "quick": args.quick,
            "kernels": results,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
