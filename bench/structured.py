"""Structured output's cost: `python -m bench.structured --checkpoint CKPT` (e.g. `python -m
bench.make_checkpoint --shape gpt2 /tmp/gpt2ck` for GPT-2 small's shape and its 50,257-token vocabulary).

1. The grammar engine (model/grammar.py) on a 20-field JSON schema (strings with maxLength, integer ranges,
   enums, booleans, all required), for the checkpoint's tokenizer: a compile (a new schema each time), a
   cache hit, a new request's matcher from the cache, and one mask's fill per token (median, p99) over
   constrained walks, each token drawn at random among those the mask allows. `--compare` times xgrammar the
   same way when it is installed (the engine not used; the commit that chose llguidance says why).
2. Serving: the engine in process (no HTTP), closed loop at each `--concurrency` C: C requests at a time
   (at least 2 in all), each sampled (`--temperature`, 1 by default; seeded) under the schema until its JSON is
   complete, and the same workload unconstrained, each request generating as many tokens as its constrained twin
   (ignore_eos), so both runs have the same batch shapes. After a warm-up, the two run in turns, `--rounds`
   times, which goes first alternating; each reports wall and CPU ms per output token (the median round), the
   constrained run's overhead over the free one, and the share of its wall time the engine spent filling masks
   (its counters).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

import numpy as np

from bench.common import base_parser, machine_info, resolve, write_result
from loadtest.prompts import BUILTIN_PASSAGE, build_prompts
from model.checkpoint import load_model, load_tokenizer
from model.grammar import GrammarCompiler, GrammarSpec, allowed_tokens, bitmask_words, fill_bitmasks
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer
from server.engine import Engine


def schema(fields: int = 20, variant: int = 0) -> dict:
    """`fields` required properties in four kinds; `variant` renames them (a schema the cache has not seen)."""
    kinds = [
        {"type": "string", "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["alpha", "beta", "gamma"]},
        {"type": "boolean"},
    ]
    props = {f"field_{i}_{variant}": kinds[i % 4] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def percentiles(samples: list[float]) -> dict:
    return {
        "median_us": float(np.median(samples) * 1e6),
        "p99_us": float(np.percentile(samples, 99) * 1e6),
        "count": len(samples),
    }


def walk_llguidance(tokenizer: Tokenizer, vocab_size: int, walks: int, compiles: int) -> dict:
    compiler = GrammarCompiler(tokenizer, vocab_size)
    compiler.compile(GrammarSpec.json_schema(schema(variant=-1)))  # the tokenizer's tables, built once
    compile_s = []
    for i in range(compiles):
        began = time.perf_counter()
        compiler.compile(GrammarSpec.json_schema(schema(variant=i)))
        compile_s.append(time.perf_counter() - began)
    spec = GrammarSpec.json_schema(schema(variant=0))
    hit_s, matcher_s = [], []
    for _ in range(1000):
        began = time.perf_counter()
        compiler.compile(GrammarSpec.json_schema(schema(variant=0)))  # the spec's text built and looked up
        hit_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        compiler.matcher(spec)
        matcher_s.append(time.perf_counter() - began)
    bitmask = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    eos, rng, fill_s, tokens = set(tokenizer.eos_token_ids), random.Random(0), [], 0
    for _ in range(walks):
        matcher = compiler.matcher(spec)
        while not matcher.complete:
            began = time.perf_counter()
            fill_bitmasks([(matcher, 0, [])], bitmask)
            fill_s.append(time.perf_counter() - began)
            allowed = allowed_tokens(bitmask, vocab_size)[0].nonzero()[:, 0].tolist()
            choices = [t for t in allowed if t not in eos] or allowed
            assert matcher.accept(rng.choice(choices))
            tokens += 1
    return {
        "engine": "llguidance",
        "compile_ms": {"median": statistics.median(compile_s) * 1e3, "min": min(compile_s) * 1e3},
        "cache_hit_us": statistics.median(hit_s) * 1e6,
        "matcher_from_cache_us": statistics.median(matcher_s) * 1e6,
        "mask_fill": percentiles(fill_s),
        "walk_tokens_mean": tokens / walks,
    }


def walk_xgrammar(tokenizer: Tokenizer, vocab_size: int, walks: int, compiles: int) -> dict | None:
    try:
        import xgrammar
    except ImportError:
        return None
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    info = xgrammar.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids))
    fresh = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = []
    for i in range(compiles):
        began = time.perf_counter()
        fresh.compile_json_schema(json.dumps(schema(variant=i)), any_whitespace=False)
        compile_s.append(time.perf_counter() - began)
    cached = xgrammar.GrammarCompiler(info, max_threads=1)
    compiled = cached.compile_json_schema(json.dumps(schema(variant=0)), any_whitespace=False)
    hit_s = []
    for _ in range(1000):
        began = time.perf_counter()
        cached.compile_json_schema(json.dumps(schema(variant=0)), any_whitespace=False)
        hit_s.append(time.perf_counter() - began)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    eos, rng, fill_s, tokens = set(tokenizer.eos_token_ids), random.Random(0), [], 0
    for _ in range(walks):
        matcher = xgrammar.GrammarMatcher(compiled)
        while not matcher.is_terminated():
            began = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fill_s.append(time.perf_counter() - began)
            allowed = allowed_tokens(bitmask.numpy(), vocab_size)[0].nonzero()[:, 0].tolist()
            choices = [t for t in allowed if t not in eos] or allowed
            assert matcher.accept_token(rng.choice(choices))
            tokens += 1
    return {
        "engine": "xgrammar",
        "compile_ms": {"median": statistics.median(compile_s) * 1e3, "min": min(compile_s) * 1e3},
        "cache_hit_us": statistics.median(hit_s) * 1e6,
        "mask_fill": percentiles(fill_s),
        "walk_tokens_mean": tokens / walks,
    }


def closed_loop(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> dict:
    """Runs one request per params, `concurrency` at a time, stepping the engine on this thread."""
    sinks: list[list] = []
    masks_before = engine.counters().structured_output.mask_seconds
    wall, cpu = time.perf_counter(), time.process_time()
    while True:
        running = [s for s in sinks if not (s and s[-1].finished)]
        while len(running) < concurrency and len(sinks) < len(params):
            sink: list = []
            engine.submit(prompts[len(sinks) % len(prompts)], params[len(sinks)], sink.append)
            sinks.append(sink)
            running.append(sink)
        if not running:
            break
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    lengths = [sum(1 for e in s if e.token_id is not None) for s in sinks]
    mask_s = engine.counters().structured_output.mask_seconds - masks_before
    return {"lengths": lengths, "tokens": sum(lengths), "wall_s": wall, "cpu_s": cpu, "mask_s": mask_s}


def serving(
    engine: Engine, prompts: list[list[int]], concurrency: int, rounds: int, max_new_tokens: int, temperature: float
) -> dict:
    spec = GrammarSpec.json_schema(schema())
    count = max(2, concurrency)
    constrained = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i, grammar=spec)
        for i in range(count)
    ]
    lengths = closed_loop(engine, prompts, constrained, concurrency)["lengths"]  # a warm-up; seeded: the same each run
    free = [
        SamplingParams(max_new_tokens=n, temperature=temperature, seed=i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    runs: dict[str, list[dict]] = {"constrained": [], "free": []}
    for i in range(rounds):  # in turns, the first of a round alternating
        for name in ("constrained", "free") if i % 2 == 0 else ("free", "constrained"):
            runs[name].append(closed_loop(engine, prompts, constrained if name == "constrained" else free, concurrency))
    out: dict = {"concurrency": concurrency, "requests": count}
    for name, rs in runs.items():
        out[name] = {
            "tokens": rs[0]["tokens"],
            "wall_ms_per_token": statistics.median(r["wall_s"] / r["tokens"] * 1e3 for r in rs),
            "cpu_ms_per_token": statistics.median(r["cpu_s"] / r["tokens"] * 1e3 for r in rs),
        }
    c, f = out["constrained"], out["free"]
    out["overhead_wall"] = c["wall_ms_per_token"] / f["wall_ms_per_token"] - 1
    out["overhead_cpu"] = c["cpu_ms_per_token"] / f["cpu_ms_per_token"] - 1
    out["mask_share_of_wall"] = statistics.median(r["mask_s"] / r["wall_s"] for r in runs["constrained"])
    out["truncated"] = sum(n >= max_new_tokens for r in runs["constrained"] for n in r["lengths"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.structured", __doc__)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=384, help="a cap; each JSON ends on its own before it")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (the exact kernels' masked pick)")
    ap.add_argument("--walks", type=int, default=5, help="constrained walks the mask fills are timed over")
    ap.add_argument("--compiles", type=int, default=10)
    ap.add_argument("--compare", action="store_true", help="time xgrammar's compile and masks too, if installed")
    ap.add_argument("--grammar-only", action="store_true", help="skip the serving runs")
    ap.add_argument("--name", default="structured", help="the result's file name in the output folder")
    ap.add_argument("--note", default=None, help="recorded with the result (e.g. what else ran on the machine)")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.rounds, args.walks, args.compiles = "1,4", 1, 2, 3
    device, dtype = resolve(args)
    tokenizer = load_tokenizer(args.checkpoint)
    model = load_model(args.checkpoint, device=device, dtype=dtype, kernels="auto", quantization=args.quantization)
    vocab_size = model.config.vocab_size
    grammar = [walk_llguidance(tokenizer, vocab_size, args.walks, args.compiles)]
    if args.compare:
        grammar.append(walk_xgrammar(tokenizer, vocab_size, args.walks, args.compiles))
    for g in filter(None, grammar):
        print(
            f"{g['engine']:>10}: compile {g['compile_ms']['median']:.2f} ms, cache hit {g['cache_hit_us']:.1f} us, "
            f"mask {g['mask_fill']['median_us']:.1f} us median, {g['mask_fill']['p99_us']:.1f} us p99"
        )
    runs = []
    if not args.grammar_only:
        engine = Engine(model, tokenizer, threads=args.threads, max_num_seqs=64)
        prompts = [tokenizer.encode(p) for p in build_prompts([BUILTIN_PASSAGE], 16, 32, tokenizer, seed=1)]
        gc.collect()
        gc.freeze()  # as the server does once loaded: a full collection lands in neither run
        for c in (int(c) for c in args.concurrency.split(",")):
            run = serving(engine, prompts, c, args.rounds, args.max_new_tokens, args.temperature)
            runs.append(run)
            print(
                f"c={c}: {run['constrained']['wall_ms_per_token']:.2f} ms/token constrained, "
                f"{run['free']['wall_ms_per_token']:.2f} free: {run['overhead_wall']:+.1%} wall "
                f"({run['overhead_cpu']:+.1%} CPU), masks {run['mask_share_of_wall']:.2%} of the wall time"
            )
    write_result(
        args.name,
        {
            "benchmark": "structured",
            "machine": machine_info(device, dtype),
            "note": args.note,
            "checkpoint": args.checkpoint,
            "vocab_size": vocab_size,
            "schema_fields": 20,
            "rounds": args.rounds,
            "temperature": args.temperature,
            "grammar": [g for g in grammar if g is not None],
            "serving": runs,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
