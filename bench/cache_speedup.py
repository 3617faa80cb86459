"""Cached vs uncached decoding, offline: `python -m bench.cache_speedup [--quick]`.

Per-token decode latency at several context lengths (batch 1 and 8): the cached step feeds one
token and reads the rest from the KV cache; the uncached step recomputes the whole sequence.
Then the total time to generate from a 32-token prompt, both ways, greedy. Timings are taken in
turns (cached, uncached, cached, ...) in the same run; medians of the repeats are reported.
"""
from __future__ import annotations

import torch

from bench.common import base_parser, interleaved_medians, machine_info, resolve, write_result
from model.checkpoint import load_model
from model.generate import decode_one_token, full_recompute, prefill
from model.gpt import GPT
from model.kv_cache import KVCache

PROMPT_TOKENS = 32


def decode_step_latency(model: GPT, context: int, batch: int, repeats: int, compiled: bool) -> dict:
    """One new token at position context - 1, after context - 1 tokens, attending over `context`."""
    device, dtype = model.transformer.wte.weight.device, model.transformer.wte.weight.dtype
    gen = torch.Generator().manual_seed(context * 100 + batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(device)  # (B, C)
    cache = KVCache(model.config, batch, max_len=context, dtype=dtype, device=device)
    slots = slice(0, batch)
    positions = torch.arange(context - 1, device=device).expand(batch, -1)  # (B, C - 1)
    last = torch.full((batch,), context - 2, device=device)  # (B,)
    prefill(model, cache, ids[:, :-1], positions, slots, last)
    new_pos = torch.full((batch,), context - 1, device=device)  # (B,)

    def cached():  # rewrites the same cache column each time: the same work every repeat
        return decode_one_token(model, cache, ids[:, -1], new_pos, slots, kv_len=context)

    def cached_compiled():
        return decode_one_token(model, cache, ids[:, -1], new_pos, slots, kv_len=context, compiled=True)

    def uncached():
        return full_recompute(model, ids)  # (B, V)

    fns = {"cached": cached, "uncached": uncached} | ({"cached_compiled": cached_compiled} if compiled else {})
    diffs = {name: (fn().float() - uncached().float()).abs().max().item() for name, fn in fns.items()}
    times = interleaved_medians(fns, device, repeats, warmup=2)
    ms = {name: t["median_s"] * 1e3 for name, t in times.items()}
    row = {"context": context, "batch": batch, "cached_ms": ms["cached"], "uncached_ms": ms["uncached"],
           "uncached_over_cached": ms["uncached"] / ms["cached"], "max_abs_logit_diff": diffs["cached"],
           "samples_s": times}
    if compiled:
        row |= {"cached_compiled_ms": ms["cached_compiled"],
                "uncached_over_cached_compiled": ms["uncached"] / ms["cached_compiled"],
                "max_abs_logit_diff_compiled": diffs["cached_compiled"]}
    return row


@torch.inference_mode()
def generate_cached(model: GPT, prompt: torch.Tensor, new_tokens: int, compiled: bool = False) -> list[int]:
    """Greedy, batch 1: prefill the prompt (1, T), then one cached step per token."""
    device, dtype = prompt.device, model.transformer.wte.weight.dtype
    T = prompt.shape[1]
    cache = KVCache(model.config, 1, max_len=T + new_tokens, dtype=dtype, device=device)
    slots = slice(0, 1)
    logits = prefill(model, cache, prompt, torch.arange(T, device=device)[None], slots,
                     torch.tensor([T - 1], device=device))  # (1, V)
    out = []
    for i in range(new_tokens):
        token = logits.argmax(dim=-1)  # (1,)
        out.append(token)
        if i < new_tokens - 1:
            logits = decode_one_token(model, cache, token, torch.tensor([T + i], device=device), slots,
                                      kv_len=T + i + 1, compiled=compiled)
    return torch.cat(out).tolist()


@torch.inference_mode()
def generate_uncached(model: GPT, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy, batch 1: the whole growing sequence through the model for every token."""
    ids = prompt  # (1, T)
    for _ in range(new_tokens):
        token = full_recompute(model, ids).argmax(dim=-1)  # (1,)
        ids = torch.cat([ids, token[:, None]], dim=1)  # (1, T + 1)
    return ids[0, prompt.shape[1]:].tolist()


def generation_total(model: GPT, new_tokens: int, repeats: int, compiled: bool) -> dict:
    device = model.transformer.wte.weight.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), generator=gen).to(device)  # (1, T)
    uncached_ids = generate_uncached(model, prompt, new_tokens)
    fns = {"cached": lambda: generate_cached(model, prompt, new_tokens),
           "uncached": lambda: generate_uncached(model, prompt, new_tokens)}
    if compiled:
        fns["cached_compiled"] = lambda: generate_cached(model, prompt, new_tokens, compiled=True)
    same = {name: fn() == uncached_ids for name, fn in fns.items() if name != "uncached"}
    times = interleaved_medians(fns, device, repeats, warmup=1)
    cached_s, uncached_s = times["cached"]["median_s"], times["uncached"]["median_s"]
    row = {"prompt_tokens": PROMPT_TOKENS, "new_tokens": new_tokens, "batch": 1,
           "cached_s": cached_s, "uncached_s": uncached_s,
           "cached_tokens_per_s": new_tokens / cached_s, "uncached_tokens_per_s": new_tokens / uncached_s,
           "uncached_over_cached": uncached_s / cached_s, "same_greedy_tokens": same["cached"], "samples_s": times}
    if compiled:
        compiled_s = times["cached_compiled"]["median_s"]
        row |= {"cached_compiled_s": compiled_s, "cached_compiled_tokens_per_s": new_tokens / compiled_s,
                "uncached_over_cached_compiled": uncached_s / compiled_s,
                "same_greedy_tokens_compiled": same["cached_compiled"]}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.cache_speedup", __doc__)
    ap.add_argument("--contexts", default="64,128,256,512", help="context lengths (capped at the model's)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=None, help="default 20 (3 with --quick)")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    model = load_model(args.checkpoint, device=device, dtype=dtype)
    limit = model.config.n_positions
    contexts = sorted({min(int(c), limit) for c in args.contexts.split(",")})
    if args.quick:
        contexts = contexts[:2]
    repeats = args.repeats or (3 if args.quick else 20)
    new_tokens = min(512, limit) - PROMPT_TOKENS if not args.quick else min(32, limit - PROMPT_TOKENS)
    steps = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in contexts:
            row = decode_step_latency(model, context, batch, repeats, args.compile)
            compiled = (f", compiled {row['cached_compiled_ms']:.2f} ms "
                        f"({row['uncached_over_cached_compiled']:.2f}x)" if args.compile else "")
            print(f"batch {batch:2d} context {context:4d}: cached {row['cached_ms']:.2f} ms, "
                  f"uncached {row['uncached_ms']:.2f} ms, uncached/cached {row['uncached_over_cached']:.2f}x"
                  + compiled)
            steps.append(row)
    total = generation_total(model, new_tokens, max(1, repeats // 4) if not args.quick else 1, args.compile)
    compiled = (f", compiled {total['cached_compiled_s']:.2f} s ({total['uncached_over_cached_compiled']:.2f}x, "
                f"same tokens: {total['same_greedy_tokens_compiled']})" if args.compile else "")
    print(f"generate {new_tokens} tokens from {PROMPT_TOKENS}: cached {total['cached_s']:.2f} s, "
          f"uncached {total['uncached_s']:.2f} s, uncached/cached {total['uncached_over_cached']:.2f}x, "
          f"same greedy tokens: {total['same_greedy_tokens']}" + compiled)
    result = {"benchmark": "cache_speedup", "machine": machine_info(device, dtype), "checkpoint": args.checkpoint,
              "model": model.config.to_hf_dict(), "quick": args.quick, "repeats": repeats, "compile": args.compile,
              "decode_step": steps, "generation": total}
    write_result("cache_speedup", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
