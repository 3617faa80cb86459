"""A random checkpoint at a real model's size, for benchmarks:
`python -m bench.make_checkpoint --shape gpt2|gpt2-medium|smollm2-135m|qwen2.5-0.5b|qwen3-0.6b|llama-3.2-1b OUT`.

Writes an HF-format directory (config.json, model.safetensors, tokenizer.json) that our server, llama.cpp's
converter and vLLM all load. GPT-2 shapes: config.json with GPT-2's keys (`n_ctx` included), GPT-2's
initialisation (normal, std 0.02; residual projections scaled by depth), float32. Llama, Qwen2 and Qwen3
shapes (model/models/presets.py): written by transformers' own class for the architecture
(LlamaForCausalLM, ...) with its initialisation, in bfloat16 as the published checkpoints are, with a
generation_config.json. The weights are not trained: the timing of a step does not depend on the values.
The tokenizer is a byte-level BPE of the model's tokenizer size (GPT-2's 50,257 tokens, SmolLM2's 49,152,
...), trained on text found on this machine (documentation and Python sources), so prompts tokenize to
realistic lengths; its `<|endoftext|>` (id 0) is the checkpoint's BOS and EOS. Write it outside the
repository (e.g. /root/ckpt/gpt2): it is 0.3-2.5 GB.
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
from model.models.presets import PRESETS
from model.tokenizer import Tokenizer, train_tokenizer

GPT2_VOCAB = 50257
SHAPES = {  # GPT-2's published shapes
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
}
# The published tokenizers' sizes (special tokens included); Qwen's embedding has more rows than its tokenizer.
TOKENIZER_SIZES = {
    **{shape: GPT2_VOCAB for shape in SHAPES},
    "smollm2-135m": 49152,
    "llama-3.2-1b": 128256,
    "qwen2.5-0.5b": 151665,
    "qwen3-0.6b": 151669,
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
    ap.add_argument("--shape", choices=sorted(TOKENIZER_SIZES), default="gpt2")
    ap.add_argument("--text-mb", type=int, default=64, help="how much of the machine's text trains the tokenizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer-from",
        default=None,
        metavar="CHECKPOINT",
        help="reuse this checkpoint's tokenizer (of the shape's size) instead of training one",
    )
    args = ap.parse_args(argv)
    start = time.perf_counter()
    size = TOKENIZER_SIZES[args.shape]
    if args.tokenizer_from:
        tokenizer = load_tokenizer(args.tokenizer_from)
    else:
        tokenizer = train_tokenizer(machine_text(args.text_mb << 20), vocab_size=size)
    if tokenizer.vocab_size != size:
        print(
            f"the tokenizer has {tokenizer.vocab_size} tokens, not {size}: raise --text-mb (or pass "
            f"--tokenizer-from a checkpoint whose tokenizer has {size})",
            file=sys.stderr,
        )
        return 1
    print(f"tokenizer: {tokenizer.vocab_size} tokens in {time.perf_counter() - start:.0f} s", flush=True)
    if args.shape in PRESETS:
        return write_family_checkpoint(args.shape, tokenizer, Path(args.out), args.seed)
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


def write_family_checkpoint(shape: str, tokenizer: Tokenizer, out: Path, seed: int) -> int:
    """The preset's shape through transformers' own class, with its initialisation, saved in bfloat16."""
    import transformers

    keys = {k: v for k, v in PRESETS[shape].items() if k not in ("architectures", "model_type", "torch_dtype")}
    keys.update(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = transformers.AutoConfig.for_model(PRESETS[shape]["model_type"], **keys)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model_class = type(model)
    assert model_class.__name__ == PRESETS[shape]["architectures"][0], model_class
    model.save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    (out / "README.md").write_text(
        f"# Random {shape}-shaped {model_class.__name__} (benchmarks only)\n\n"
        f"Untrained: transformers' initialisation (std {config.initializer_range:.3g}), seed {seed}, bfloat16. "
        f"Written by `python -m bench.make_checkpoint --shape {shape}`.\n"
    )
    print(f"wrote {out}: {model.num_parameters() / 1e6:.1f} M parameters, {model_class.__name__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
