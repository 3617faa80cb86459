"""Train the tokenizer and the model on text files: `python -m model.train --out checkpoints/NAME`.

AdamW, linear warmup then cosine decay, gradient clipping, periodic validation reporting loss and
bits per byte, resumable from `train_state.pt` in the output directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from model.checkpoint import TOKENIZER_FILE, save_checkpoint
from model.config import PRESETS
from model.data import download_shakespeare, split_files
from model.gpt import GPT
from model.tokenizer import Tokenizer, train_tokenizer

STATE_FILE = "train_state.pt"


def encode_documents(tokenizer: Tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one id stream, each document followed by <|endoftext|>."""
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(f.read_text(encoding="utf-8")) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, max_steps: int, warmup: int, lr: float, min_lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def random_batch(
    data: torch.Tensor, batch_size: int, block: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - block - 1, (batch_size,), generator=gen)  # (B,)
    idx = starts[:, None] + torch.arange(block + 1)  # (B, block + 1), on the CPU like `data` (batches move later)
    window = data[idx]
    return window[:, :-1], window[:, 1:]  # (B, block), (B, block)


@torch.no_grad()
def evaluate(
    model: GPT,
    data: torch.Tensor,
    token_bytes: torch.Tensor,
    block: int,
    batch_size: int,
    max_batches: int | None = None,
) -> dict[str, float]:
    """Mean loss (nats/token) and bits per byte over contiguous windows of `data`."""
    model.eval()
    n_windows = (len(data) - 1) // block
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    for start in range(0, n_windows, batch_size):
        rows = torch.arange(start, min(start + batch_size, n_windows), device=data.device)[
            :, None
        ] * block + torch.arange(block + 1, device=data.device)  # (b, block + 1)
        window = data[rows]  # (b, block + 1)
        x, y = window[:, :-1], window[:, 1:]
        logits = model(x)  # (b, block, V)
        nats = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        total_nats += float(nats)
        total_tokens += y.numel()
        total_bytes += int(token_bytes[y].sum())
    model.train()
    loss = total_nats / total_tokens
    return {
        "loss": loss,
        "bits_per_byte": total_nats / math.log(2) / total_bytes,
        "tokens": total_tokens,
        "bytes": total_bytes,
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m model.train", description=__doc__)
    ap.add_argument("--data", nargs="*", default=None, help="text files or folders (default: Shakespeare)")
    ap.add_argument("--val", nargs="*", default=None, help="held-out files (default: a few whole plays)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-embd", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="context length (n_positions)")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-interval", type=int, default=200)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    return ap.parse_args(argv)


def collect_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.txt")) if p.is_dir() else [p]
    return files


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.data is None:
        train_files, val_files = split_files(download_shakespeare())
    else:
        train_files = collect_files(args.data)
        val_files = collect_files(args.val) if args.val else []
        if not val_files:  # hold out the last file, or the tail of a single file
            train_files, val_files = (train_files[:-1], train_files[-1:]) if len(train_files) > 1 else (train_files, [])
    base = PRESETS[args.preset]
    overrides = {
        k: v
        for k, v in dict(
            vocab_size=args.vocab_size,
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            n_head=args.n_head,
            n_positions=args.block_size,
        ).items()
        if v is not None
    }
    config = base.replace(dropout=args.dropout, **overrides)

    state = torch.load(out / STATE_FILE, weights_only=False) if args.resume and (out / STATE_FILE).exists() else None
    if state is not None or (args.resume and (out / TOKENIZER_FILE).exists()):
        tokenizer = Tokenizer.from_file(out / TOKENIZER_FILE)
    else:
        texts = [f.read_text(encoding="utf-8") for f in train_files]
        tokenizer = train_tokenizer(texts, config.vocab_size)
        tokenizer.save(out / TOKENIZER_FILE)
    config = config.replace(
        vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id
    )
    train_data = encode_documents(tokenizer, train_files)
    if val_files:
        val_data = encode_documents(tokenizer, val_files)
    else:
        cut = int(len(train_data) * 0.9)
        train_data, val_data = train_data[:cut], train_data[cut:]
    block = min(config.n_positions, len(val_data) - 1, len(train_data) - 2)
    token_bytes = torch.tensor([len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)])

    device = torch.device(args.device)
    model = GPT(config).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    step, history, elapsed_before = 0, [], 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        step, history, elapsed_before = state["step"], state["history"], state["elapsed_s"]
    print(
        f"model: {config}\nparameters: {model.num_parameters():,}; train tokens {len(train_data):,}, "
        f"val tokens {len(val_data):,}; block {block}",
        file=sys.stderr,
    )

    def save_state(elapsed: float) -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "generator": gen.get_state(),
                "step": step,
                "history": history,
                "elapsed_s": elapsed,
            },
            out / STATE_FILE,
        )

    start = time.perf_counter()
    bar = tqdm(total=args.max_steps, initial=step, file=sys.stderr, dynamic_ncols=True)
    model.train()
    train_loss = float("nan")
    while step < args.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.max_steps, args.warmup, args.lr, args.min_lr)
        x, y = random_batch(train_data, args.batch_size, block, gen)
        logits = model(x.to(device))  # (B, block, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        train_loss = loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss:.3f}")
        if step % args.eval_interval == 0 or step == args.max_steps:
            val = evaluate(
                model,
                val_data.to(device),
                token_bytes.to(device),
                block,
                args.batch_size,
                None if step == args.max_steps else args.eval_batches,
            )
            elapsed = elapsed_before + time.perf_counter() - start
            history.append(
                {
                    "step": step,
                    "train_loss": train_loss,
                    "val_loss": val["loss"],
                    "val_bits_per_byte": val["bits_per_byte"],
                    "elapsed_s": round(elapsed, 1),
                }
            )
            tqdm.write(json.dumps(history[-1]), file=sys.stderr)
            save_state(elapsed)
    bar.close()
    elapsed = elapsed_before + time.perf_counter() - start
    final = evaluate(model, val_data.to(device), token_bytes.to(device), block, args.batch_size)
    summary = {
        "config": config.to_hf_dict(),
        "parameters": model.num_parameters(),
        "steps": step,
        "batch_size": args.batch_size,
        "block_size": block,
        "train_loss": train_loss,
        "val_loss": final["loss"],
        "val_bits_per_byte": final["bits_per_byte"],
        "val_tokens": final["tokens"],
        "train_files": [f.name for f in train_files],
        "val_files": [f.name for f in val_files],
        "train_tokens": len(train_data),
        "elapsed_s": round(elapsed, 1),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "history": history,
        "command_args": " ".join(argv if argv is not None else sys.argv[1:]),
    }
    save_checkpoint(model, tokenizer, out)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("steps", "train_loss", "val_loss", "val_bits_per_byte", "elapsed_s")}))
    return summary


if __name__ == "__main__":
    main()
