"""What each dtype and quantization costs in quality: `python -m bench.quality`.

Runs the default model's held-out plays (model/data.py: whole plays the model never trained on)
through the inference path (forward_step + compute_logits, windows of the model's context, no
overlap) once per configuration, and compares each with float32 (the exact kernels):
- bits per byte: the text's negative log-likelihood in bits over its UTF-8 bytes (lower is better);
- KL: the mean KL divergence of the next-token distribution from float32's, in nats;
- top-1: how often the most likely next token is float32's.
llama.cpp's `llama-perplexity --kl-divergence` reports the same three for its quantizations.
"""

from __future__ import annotations

import math

import torch

from bench.common import base_parser, machine_info, resolve, write_result
from model.checkpoint import load_model, load_tokenizer
from model.data import download_shakespeare, split_files
from model.generate import sequence_cache
from model.kv_cache import StepBatch

CONFIGS = {  # name: (dtype, quantization, KV cache dtype: None is the model's)
    "float32": (torch.float32, None, None),
    "bfloat16": (torch.bfloat16, None, None),
    "int8": (torch.float32, "int8", None),
    "float32-kv-bf16": (torch.float32, None, torch.bfloat16),
    "int8-kv-bf16": (torch.float32, "int8", torch.bfloat16),
    "float32-kv-int8": (torch.float32, None, torch.int8),
    "int8-kv-int8": (torch.float32, "int8", torch.int8),
}


def held_out_ids(tokenizer, max_tokens: int) -> tuple[list[int], int]:
    """The held-out plays' token ids (at most max_tokens, whole plays first) and the UTF-8 bytes they cover."""
    _, val = split_files(download_shakespeare())
    ids: list[int] = []
    for path in val:
        ids += tokenizer.encode(path.read_text(encoding="utf-8"))
    ids = ids[:max_tokens]
    return ids, len(tokenizer.decode(ids).encode("utf-8"))


def window_log_probs(model, ids: list[int], cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Next-token log-probabilities (T, V), float32, for one window of ids from position 0."""
    cache, blocks = sequence_cache(model, len(ids), dtype=cache_dtype)
    step = StepBatch.build([(ids, 0, blocks)], cache.block_size, model.device)
    return model.compute_logits(model.forward_step(step, cache)).log_softmax(-1)  # (T, V)


def main(argv: list[str] | None = None) -> int:
    ap = base_parser("python -m bench.quality", __doc__)
    ap.add_argument("--max-tokens", type=int, default=32768, help="held-out tokens scored (from the start)")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args(argv)
    device, _ = resolve(args)
    tokenizer = load_tokenizer(args.checkpoint)
    ids, n_bytes = held_out_ids(tokenizer, 2048 if args.quick else args.max_tokens)
    models = {
        name: load_model(args.checkpoint, device=device, dtype=CONFIGS[name][0], quantization=CONFIGS[name][1])
        for name in dict.fromkeys(["float32", *args.configs])
    }
    context = next(iter(models.values())).config.context_length
    nll = {name: 0.0 for name in models}
    kl = {name: 0.0 for name in models}
    agree = {name: 0 for name in models}
    scored = 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context + 1]
        inputs, targets = window[:-1], torch.tensor(window[1:])
        ref = window_log_probs(models["float32"], inputs)  # (T, V)
        for name, model in models.items():
            lp = ref if name == "float32" else window_log_probs(model, inputs, CONFIGS[name][2])  # (T, V)
            nll[name] -= lp.gather(1, targets[:, None]).sum().item()
            kl[name] += (ref.exp() * (ref - lp)).sum().item()
            agree[name] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
        scored += len(targets)
    scored_bytes = n_bytes  # the first token is not predicted; its bytes are a rounding error of this measure
    rows = {}
    for name in models:
        rows[name] = {
            "bits_per_byte": nll[name] / math.log(2) / scored_bytes,
            "kl_nats": kl[name] / scored,
            "top1_agreement": agree[name] / scored,
            "dtype": str(CONFIGS[name][0]).removeprefix("torch."),
            "quantization": CONFIGS[name][1],
            "kv_cache_dtype": str(CONFIGS[name][2] or CONFIGS[name][0]).removeprefix("torch."),
        }
        row, delta = rows[name], rows[name]["bits_per_byte"] - rows["float32"]["bits_per_byte"]
        print(
            f"{name:9s} bits/byte {row['bits_per_byte']:.4f} (Δ {delta:+.4f})  KL {row['kl_nats']:.2e} nats  "
            f"top-1 {row['top1_agreement']:.2%}",
            flush=True,
        )
    write_result(
        "quality",
        {
            "benchmark": "quality",
            "machine": machine_info(device),
            "checkpoint": args.checkpoint,
            "tokens": scored,
            "bytes": scored_bytes,
            "results": rows,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
