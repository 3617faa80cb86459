"""A random checkpoint at a real GPT-2 size, for benchmarks:
`python -m bench.make_checkpoint --shape gpt2|gpt2-medium OUT`.

Writes an HF-format directory (config.json with GPT-2's keys, `n_ctx` included; model.safetensors;
tokenizer.json) that our server, llama.cpp's converter and vLLM all load. The weights are GPT-2's
initialisation (normal, std 0.02; residual projections scaled by depth), not trained: the timing of
a step does not depend on the values. The tokenizer is a byte-level BPE of GPT-2's 50,257 tokens,
trained on text found on this machine (documentation and Python sources), so prompts tokenize to
realistic lengths. Write it outside the repository (e.g. /root/ckpt/gpt2): it is 0.5-1.4 GB.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from model.checkpoint import load_tokenizer, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import train_tokenizer

GPT2_VOCAB = 50257
SHAPES = {  # GPT-2's published shapes
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
}
TEXT_ROOTS = ("/usr/share/doc", "/usr/share/common-licenses", sysconfig.get_paths()["stdlib"])
TEXT_SUFFIXES = ("", ".txt", ".md", ".rst", ".py", ".html")


def machine_text(max_bytes: int, roots: tuple[str, ...] = TEXT_ROOTS) -> Iterator[str]:
    """Plain-text files under `roots` (sorted, so the same machine gives the same corpus), up to
    max_bytes in all; binary and unreadable files are skipped."""
    total = 0
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if total >= max_bytes:
                return
            if not path.is_file() or path.is_symlink() or path.suffix not in TEXT_SUFFIXES:
                continue
            try:
                data = path.read_bytes()[: 1 << 20]
                text = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            total += len(data)
            yield text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.make_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("out", help="the checkpoint directory to write (outside the repository)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    ap.add_argument("--text-mb", type=int, default=64, help="how much of the machine's text trains the tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer-from",
        default=None,
        metavar="CHECKPOINT",
        help="reuse this checkpoint's 50,257-token tokenizer instead of training one",
    )
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer_from:
        tokenizer = load_tokenizer(args.tokenizer_from)
    else:
        tokenizer = train_tokenizer(machine_text(args.text_mb << 20), vocab_size=GPT2_VOCAB)
    if tokenizer.vocab_size != GPT2_VOCAB:
        print(
            f"the machine's text gave only {tokenizer.vocab_size} tokens, not {GPT2_VOCAB}: raise --text-mb",
            file=sys.stderr,
        )
        return 1
    print(f"tokenizer: {tokenizer.vocab_size} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    config = GPTConfig(
        vocab_size=GPT2_VOCAB,
        n_positions=1024,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **SHAPES[args.shape],
    )
    torch.manual_seed(args.seed)
    model = GPT(config).eval()  # GPT-2's init: std 0.02, c_proj scaled by 1/sqrt(2 * n_layer)
    save_checkpoint(
        model,
        tokenizer,
        args.out,
        card=f"# Random {args.shape}-shaped GPT-2 (benchmarks only)\n\n"
        f"Untrained: GPT-2's initialisation, seed {args.seed}. Written by "
        f"`python -m bench.make_checkpoint --shape {args.shape}`.\n",
    )
    print(f"wrote {args.out}: {model.num_parameters() / 1e6:.1f} M parameters, {config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
