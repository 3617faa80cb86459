"""Our generation vs Hugging Face `transformers` on the same checkpoint: `python -m bench.vs_transformers`.

Greedy, same prompts, same number of new tokens (EOS suppressed on both sides: transformers with
min_new_tokens = max_new_tokens, ours by masking the EOS logit), batch 1 and 8, runs in turns.
Ours is the plain cached loop (one StepBatch per step over a paged cache, argmax) and, when the
checkpoint has a tokenizer, the serving engine driven in-process (scheduler, runner, sampling; no
HTTP), timed against transformers in a second pass.
"""

from __future__ import annotations

import queue
from pathlib import Path

import torch

from bench.common import base_parser, interleaved_medians, machine_info, resolve, stock_threads, write_result
from model.checkpoint import load_model, load_tokenizer
from model.description import InferenceModel
from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import SamplingParams


@torch.inference_mode()
def generate_ours(model: InferenceModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy for a batch of equal-length prompts (B, T). Returns (B, new_tokens)."""
    B, T = prompts.shape
    eos, bs = (model.config.eos_token_ids or (0,))[0], 16
    per_seq = -(-(T + new_tokens) // bs)
    cache = PagedKVCache(model.config, B * per_seq, bs, dtype=model.dtype, device=model.device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
    step = StepBatch.build([(row, 0, t) for row, t in zip(prompts.tolist(), tables)], bs, model.device)
    hidden = model.forward_step(step, cache)
    logits = model.compute_logits(hidden[step.query_start[1:].long() - 1])  # (B, V)
    out = []
    for i in range(new_tokens):
        logits[:, eos] = float("-inf")  # the same as transformers' min_new_tokens
        token = logits.argmax(dim=-1)  # (B,)
        out.append(token)
        if i < new_tokens - 1:
            step = StepBatch.build([([t], T + i, table) for t, table in zip(token.tolist(), tables)], bs, model.device)
            logits = model.compute_logits(model.forward_step(step, cache))  # (B, V)
    return torch.stack(out, dim=1)  # (B, new_tokens)


@torch.inference_mode()
def generate_transformers(hf_model, prompts: torch.Tensor, new_tokens: int, eos: int) -> torch.Tensor:
    out = hf_model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=eos,
        eos_token_id=eos,
    )
    return out[:, prompts.shape[1] :]  # (B, new_tokens)


def generate_engine(engine, prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Every prompt submitted while the engine is paused, so all of them share its steps."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    sinks = [queue.Queue() for _ in range(prompts.shape[0])]
    with engine.paused():
        for row, sink in zip(prompts.tolist(), sinks):
            engine.submit(row, params, sink.put)
    results = []
    for sink in sinks:
        outs = [sink.get(timeout=600)]
        while not outs[-1].finished:
            outs.append(sink.get(timeout=600))
        results.append([o.token_id for o in outs if o.token_id is not None])
    return results


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    ap = base_parser("python -m bench.vs_transformers", __doc__)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=None, help="default 5 (1 with --quick)")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process serving engine")
    args = ap.parse_args(argv)
    device, dtype = resolve(args)
    model = load_model(
        args.checkpoint, device=device, dtype=dtype, kernels=args.kernels if args.kernels != "both" else "auto"
    )
    hf_model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
    limit = model.config.context_length
    new_tokens = min(16 if args.quick else args.new_tokens, limit - args.prompt_tokens)
    repeats = args.repeats or (1 if args.quick else 5)
    batches = [int(b) for b in args.batches.split(",")]
    eos = (model.config.eos_token_ids or (0,))[0]
    all_prompts = {
        b: torch.randint(
            0, model.config.vocab_size, (b, args.prompt_tokens), generator=torch.Generator().manual_seed(b)
        ).to(device)
        for b in batches
    }

    def transformers_fn(prompts):
        def run():
            with stock_threads("stock"):
                return generate_transformers(hf_model, prompts, new_tokens, eos)

        return run

    # Pass 1: the bare loop against transformers. Pass 2, after it: the engine against transformers
    # again. transformers runs on torch's threads, ours on the kernels' own: each gets every core
    # while it runs (stock_threads), and an engine's thread never runs beside pass 1.
    rows = []
    for batch, prompts in all_prompts.items():
        fns = {
            "ours": lambda prompts=prompts: generate_ours(model, prompts, new_tokens),
            "transformers": transformers_fn(prompts),
        }
        same = (generate_ours(model, prompts, new_tokens) == fns["transformers"]()).float().mean().item()
        times = interleaved_medians(fns, device, repeats, warmup=1)
        tps = {name: batch * new_tokens / t["median_s"] for name, t in times.items()}
        row = {
            "batch": batch,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": new_tokens,
            "tokens_per_s": tps,
            "same_token_fraction_vs_transformers": same,
            "samples_s": times,
        }
        row |= {
            f"{name}_over_transformers": v / tps["transformers"] for name, v in tps.items() if name != "transformers"
        }
        rows.append(row)
        print(
            f"batch {batch}: "
            + ", ".join(f"{n} {v:.0f} tok/s" for n, v in tps.items())
            + f"; ours/transformers {row['ours_over_transformers']:.2f}x; same tokens {same:.0%}",
            flush=True,
        )
    if not args.no_engine and (Path(args.checkpoint) / "tokenizer.json").is_file():
        from server.engine import Engine

        engines = {}
        try:
            engines["engine"] = Engine(
                model, load_tokenizer(args.checkpoint), max_num_seqs=max(batches), threads=args.threads
            ).start()
            for row, prompts in zip(rows, all_prompts.values()):
                fns = {
                    name: lambda engine=engine, prompts=prompts: generate_engine(engine, prompts, new_tokens)
                    for name, engine in engines.items()
                } | {"transformers": transformers_fn(prompts)}
                times = interleaved_medians(fns, device, repeats, warmup=1)
                tps = {name: row["batch"] * new_tokens / t["median_s"] for name, t in times.items()}
                row["engine_pass"] = {"tokens_per_s": tps, "samples_s": times}
                row |= {
                    f"{name}_over_transformers": v / tps["transformers"]
                    for name, v in tps.items()
                    if name != "transformers"
                }
                print(
                    f"batch {row['batch']}, engine pass: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in tps.items()),
                    flush=True,
                )
        finally:
            for engine in engines.values():
                engine.shutdown()
    import transformers

    result = {
        "benchmark": "vs_transformers",
        "machine": machine_info(device, dtype),
        "checkpoint": args.checkpoint,
        "transformers": transformers.__version__,
        "quick": args.quick,
        "repeats": repeats,
        "kernels": model.kernels,
        "runs": rows,
    }
    write_result("vs_transformers", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
