"""Plain generation for one prompt: `prefill`, `decode_one_token`, `recompute`, `generate`, and the CLI.

Each step is one `forward_step` of the model (GPT-2's or a decoder family's) over a `StepBatch`, the same call
the serving engine batches;
here the sequence owns a small paged cache of its own, blocks 0, 1, 2, ... in order.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer
from model.config import PromptError, check_prompt
from model.description import InferenceModel
from model.device import resolve_device, resolve_dtype
from model.kv_cache import PagedKVCache, StepBatch
from model.sampling import Penalties, SamplingBatch, SamplingParams, resolve_seed, sample
from model.text import OutputText
from model.tokenizer import Tokenizer

BLOCK_SIZE = 16


def sequence_cache(
    model: InferenceModel, length: int, block_size: int = BLOCK_SIZE, dtype: torch.dtype | None = None
) -> tuple[PagedKVCache, list[int]]:
    """A cache for one sequence of up to `length` tokens (in the model's dtype, or `dtype`), and its block table."""
    blocks = -(-length // block_size)
    cache = PagedKVCache(model.config, blocks, block_size, dtype=dtype or model.dtype, device=model.device)
    return cache, list(range(blocks))


def prefill(
    model: InferenceModel, cache: PagedKVCache, ids: list[int], blocks: list[int], start: int = 0
) -> torch.Tensor:
    """Writes tokens `ids`, at positions start.., into the cache; returns the last one's logits (1, V)."""
    step = StepBatch.build([(ids, start, blocks)], cache.block_size, model.device)
    return model.compute_logits(model.forward_step(step, cache)[-1:])  # (1, V)


def decode_one_token(
    model: InferenceModel, cache: PagedKVCache, token: int, position: int, blocks: list[int]
) -> torch.Tensor:
    """One cached step: the token at `position`, over the keys before it. Returns next-token logits (1, V)."""
    return prefill(model, cache, [token], blocks, position)


def recompute(model: InferenceModel, cache: PagedKVCache, ids: list[int], blocks: list[int]) -> torch.Tensor:
    """One uncached step: the whole sequence again, every key and value recomputed (the cache is only
    scratch). Returns the last position's logits (1, V)."""
    return prefill(model, cache, ids, blocks, 0)


@dataclass
class Step:
    token_id: int
    text: str  # text this token completed (may be '' mid-character or while a stop string is pending)
    logprob: float
    finish_reason: str | None  # on the last step: FINISH_LENGTH, FINISH_EOS or FINISH_STOP (model.text)


def generate(
    model: InferenceModel, tokenizer: Tokenizer, prompt: str | list[int], params: SamplingParams, use_cache: bool = True
) -> Iterator[Step]:
    """Yields one Step per generated token."""
    device = model.device
    ids = tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
    check_prompt(ids, params.max_new_tokens, model.config.context_length, model.config.vocab_size)
    seed = resolve_seed(params.seed)
    cache, blocks = sequence_cache(model, len(ids) + params.max_new_tokens)
    logits = prefill(model, cache, ids, blocks) if use_cache else recompute(model, cache, ids, blocks)
    output = OutputText(tokenizer, params)
    num_prompt = len(ids)
    while True:
        penalties = (
            Penalties.for_sequence(params, ids, num_prompt, model.config.vocab_size, device)
            if params.penalized
            else None
        )
        batch = SamplingBatch.from_params([params], [seed], [output.num_tokens], device, penalties)
        token, logprob = sample(logits, batch)
        token_id = int(token[0])
        text = output.push(token_id)
        yield Step(token_id, text, float(logprob[0]), output.finish_reason)
        if output.finish_reason is not None:
            return
        ids.append(token_id)
        if use_cache:
            logits = decode_one_token(model, cache, token_id, len(ids) - 1, blocks)
        else:
            logits = recompute(model, cache, ids, blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.generate", description="Generate text from a checkpoint.")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step")
    ap.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "exact", "stock"],
        help="exact: our bit-exact CPU kernels; stock: torch's (default: exact where they run)",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="int8: quantize the weights of every product at load (exact kernels; KVSERVE_ISA picks the path)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    model = load_model(
        args.checkpoint,
        device=device,
        dtype=resolve_dtype(args.dtype),
        kernels=args.kernels,
        quantization=args.quantization,
    )
    tokenizer = load_tokenizer(args.checkpoint)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    start, n, reason = time.perf_counter(), 0, None
    try:
        for step in generate(model, tokenizer, args.prompt, params, use_cache=not args.no_cache):
            sys.stdout.write(step.text)
            sys.stdout.flush()
            n, reason = n + 1, step.finish_reason
    except (PromptError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(
        f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, finish={reason}, "
        f"cache={'off' if args.no_cache else 'on'}, device={device}, kernels={model.kernels}"
        + (f" on {model.kernel_isa}" if model.kernel_isa else "")
        + (f", {model.quantization}" if model.quantization else "")
        + "]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
