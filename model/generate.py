"""Plain generation for one prompt: `prefill`, `decode_one_token`, `generate`, and the CLI.

The serving engine batches many requests with the same `prefill` / `decode_one_token` steps.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from model.checkpoint import DEFAULT_CHECKPOINT, load_model, load_tokenizer
from model.device import resolve_device, resolve_dtype
from model.gpt import GPT
from model.kv_cache import KVCache, check_slot_range
from model.sampling import SamplingParams, StopMatcher, sample
from model.tokenizer import Tokenizer


class PromptError(ValueError):
    """A prompt the model cannot run."""


def check_prompt(prompt_ids: list[int], max_new_tokens: int, context: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise PromptError("the prompt is empty: at least one token is needed")
    bad = [i for i in prompt_ids if not 0 <= i < vocab_size]
    if bad:
        raise PromptError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) >= context:
        raise PromptError(f"the prompt has {len(prompt_ids)} tokens; the context holds {context}, "
                          "so it must be shorter than that")
    if len(prompt_ids) + max_new_tokens > context:
        raise PromptError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                          f"exceeds the context of {context} tokens")


@torch.inference_mode()
def prefill(model: GPT, cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor | slice, last_index: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    """Writes the prompt's keys/values into the cache. input_ids, positions: (B, T), padding at -1.
    last_index: (B,) index of each row's last real token. Returns its logits (B, V)."""
    return model(input_ids, positions, cache=cache, slots=slots, kv_len=kv_len, logits_index=last_index)


def _decode(model: GPT, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor | int, kv_len: int | None) -> torch.Tensor:
    """slots: (B,), or an int, the first of B contiguous slots (where a slice would be a constant to
    torch.compile, and every range a recompile)."""
    index = torch.zeros_like(tokens)  # (B,): the single token of each row
    return model(tokens[:, None], positions[:, None], cache=cache, slots=slots, kv_len=kv_len, logits_index=index)


@functools.cache
def _compiled_decode() -> Callable[..., torch.Tensor]:
    """`_decode` through torch.compile, made on first use (importing the compiler costs ~100 MB and
    seconds). It compiles once per variant: one row or more, slots a range or a gather; sizes,
    lengths and the first slot are symbolic, so they do not recompile."""
    return torch.compile(_decode, dynamic=True)


@torch.inference_mode()
def decode_one_token(model: GPT, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor | slice, kv_len: int | None = None, compiled: bool = False) -> torch.Tensor:
    """One step for every row: tokens, positions: (B,). Returns next-token logits (B, V).
    compiled: run the step through `torch.compile` (inductor fuses the small ops; on the CPU it needs
    a C++ compiler, and the first step of each variant takes seconds)."""
    step = _compiled_decode() if compiled else _decode
    if isinstance(slots, slice):
        check_slot_range(slots, tokens.shape[0])
        slots = slots.start  # (what the compiled step takes: an int is symbolic, a slice a constant)
    return step(model, cache, tokens, positions, slots, kv_len)


@torch.inference_mode()
def full_recompute(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """Uncached step: the whole sequence again, plain causal. ids: (B, T). Returns the last
    position's logits (B, V), computed for that row only, as a cached step computes them."""
    B, T = ids.shape
    last = torch.full((B,), T - 1, device=ids.device)  # (B,)
    return model(ids, logits_index=last)  # (B, V)


class OutputText:
    """One request's text, token by token: EOS, stop strings (found across tokens, never leaked),
    streaming detokenization (never a torn character) and max_new_tokens. `generate` and the serving
    engine both keep one per request."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params, self.eos_token_id = params, tokenizer.eos_token_id
        self._decoder, self._stops = tokenizer.stream(skip_special=True), StopMatcher(params.stop)
        self.num_tokens = 0
        self.finish_reason: str | None = None  # 'eos', 'stop' or 'length' once the request is done

    def push(self, token_id: int) -> str:
        """The text this token completes ('' mid-character or while a stop string may be starting)."""
        self.num_tokens += 1
        eos = token_id == self.eos_token_id and not self.params.ignore_eos
        text = "" if eos else self._stops.push(self._decoder.push(token_id))
        last = eos or self._stops.matched is not None or self.num_tokens >= self.params.max_new_tokens
        if last and self._stops.matched is None:  # release what was held back: a torn character, a stop prefix
            text += self._stops.push(self._decoder.flush())
            text += self._stops.flush()
        if last:
            self.finish_reason = "stop" if self._stops.matched is not None else "eos" if eos else "length"
        return text


@dataclass
class Step:
    token_id: int
    text: str  # text this token completed (may be '' mid-character or while a stop string is pending)
    logprob: float
    finish_reason: str | None  # 'length', 'eos', 'stop' on the last step


def generate(model: GPT, tokenizer: Tokenizer, prompt: str | list[int], params: SamplingParams,
             use_cache: bool = True, compiled: bool = False) -> Iterator[Step]:
    """Yields one Step per generated token. compiled: cached decode steps through torch.compile."""
    device = next(model.parameters()).device
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    context = model.config.n_positions
    check_prompt(prompt_ids, params.max_new_tokens, context, model.config.vocab_size)
    generator = params.make_generator(device)
    ids = torch.tensor([prompt_ids], device=device)  # (1, T)
    cache = KVCache(model.config, 1, max_len=len(prompt_ids) + params.max_new_tokens,
                    dtype=next(model.parameters()).dtype, device=device) if use_cache else None
    if cache is not None:
        positions = torch.arange(ids.shape[1], device=device)[None]  # (1, T)
        logits = prefill(model, cache, ids, positions, slice(0, 1), torch.tensor([ids.shape[1] - 1], device=device))
    else:
        logits = full_recompute(model, ids)
    output = OutputText(tokenizer, params)
    history = ids[0]
    while True:
        token, logprob = sample(logits, [params], [generator], [history])
        token_id = int(token[0])
        text = output.push(token_id)
        yield Step(token_id, text, float(logprob[0]), output.finish_reason)
        if output.finish_reason is not None:
            return
        history = torch.cat([history, token])  # only for the repetition penalty; the cache is in place
        if cache is not None:
            pos = torch.tensor([history.numel() - 1], device=device)
            logits = decode_one_token(model, cache, token, pos, slice(0, 1), compiled=compiled)
        else:
            logits = full_recompute(model, history[None])


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
    ap.add_argument("--compile", action="store_true", help="decode steps through torch.compile (first one slow)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    model = load_model(args.checkpoint, device=device, dtype=resolve_dtype(args.dtype))
    tokenizer = load_tokenizer(args.checkpoint)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=tuple(args.stop))
    start, n, reason = time.perf_counter(), 0, None
    try:
        for step in generate(model, tokenizer, args.prompt, params, use_cache=not args.no_cache,
                             compiled=args.compile):
            sys.stdout.write(step.text)
            sys.stdout.flush()
            n, reason = n + 1, step.finish_reason
    except (PromptError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, finish={reason}, "
          f"cache={'off' if args.no_cache else 'on'}, device={device}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
