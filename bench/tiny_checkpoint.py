"""A random tiny checkpoint for smoke runs: `python -m bench.tiny_checkpoint DIR [--context 256]`."""

from __future__ import annotations

import argparse

import torch

from loadtest.prompts import BUILTIN_PASSAGE
from model.checkpoint import save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tiny_checkpoint", description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    args = ap.parse_args(argv)
    tokenizer = train_tokenizer([BUILTIN_PASSAGE * 20], vocab_size=400)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        n_positions=args.context,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    save_checkpoint(GPT(config).eval(), tokenizer, args.out)
    print(f"wrote {args.out}: {config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
