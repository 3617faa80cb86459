"""Prompts for a load test: cut from the Shakespeare corpus (or a built-in passage) to a token length,
or read from a file, optionally behind one shared prefix."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from model.data import DEFAULT_DATA_DIR

WORDS_PER_TOKEN = 0.75  # rule of thumb for English BPE, used only when no tokenizer is given
BUILTIN_PASSAGE = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
    "that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows bound with "
    "victorious wreaths; our bruised arms hung up for monuments; our stern alarums changed to merry "
    "meetings, our dreadful marches to delightful measures. "
)


def default_corpus() -> list[str]:
    """The Shakespeare files under data/shakespeare/ if present, else a built-in passage."""
    files = sorted(DEFAULT_DATA_DIR.glob("*.txt")) if DEFAULT_DATA_DIR.is_dir() else []
    return [f.read_text(encoding="utf-8", errors="replace") for f in files] or [BUILTIN_PASSAGE]


def build_prompts(texts: list[str], count: int, prompt_tokens: int, tokenizer=None, seed: int = 0) -> list[str]:
    """`count` prompts cut from random line starts in `texts`: exactly `prompt_tokens` tokens with a
    tokenizer (model.tokenizer.Tokenizer), else about prompt_tokens * WORDS_PER_TOKEN words."""
    rng = random.Random(seed)
    window = prompt_tokens * 8 + 64  # characters: more than enough for prompt_tokens tokens
    prompts = []
    for _ in range(count):
        text = rng.choice(texts)
        text = text * math.ceil(2 * window / len(text)) if len(text) < 2 * window else text
        start = rng.randrange(len(text) - window)
        start = text.find("\n", start, start + window // 2) + 1 or start
        chunk = text[start : start + window]
        if tokenizer is None:
            prompts.append(" ".join(chunk.split()[: max(1, round(prompt_tokens * WORDS_PER_TOKEN))]))
            continue
        ids = tokenizer.encode(chunk)[:prompt_tokens]
        while len(tokenizer.encode(tokenizer.decode(ids))) > prompt_tokens:  # re-encoding can merge differently
            ids = ids[:-1]
        prompts.append(tokenizer.decode(ids))
    return prompts


def read_prompts_file(path: str | Path) -> list[str]:
    """A JSON list of strings, or one prompt per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        return [str(p) for p in json.loads(text)]
    return [line for line in text.splitlines() if line.strip()]


def load_prompts(
    count: int,
    prompt_tokens: int,
    prompts_file: str | None,
    tokenizer_dir: str | None,
    seed: int = 0,
    shared_prefix_tokens: int = 0,
    tenants: int = 0,
) -> tuple[list[str], dict]:
    """Prompts and a note on where they came from (and their token counts, when a tokenizer is known).
    With `shared_prefix_tokens`, one passage of that many tokens (ending at a line break, so it
    tokenizes the same in front of any prompt) comes first in every prompt. With `tenants` K, there are
    K such passages (256 tokens unless `shared_prefix_tokens` says), and each prompt gets one drawn at
    random: K tenants' system prompts, the workload that KV-aware routing across replicas is for."""
    from model.checkpoint import DEFAULT_CHECKPOINT, load_tokenizer

    tokenizer_path = Path(tokenizer_dir) if tokenizer_dir else DEFAULT_CHECKPOINT
    tokenizer = load_tokenizer(tokenizer_path) if (tokenizer_path / "tokenizer.json").is_file() else None
    if prompts_file:
        prompts, source = read_prompts_file(prompts_file), str(prompts_file)
    else:
        texts = default_corpus()
        prompts = build_prompts(texts, count, prompt_tokens, tokenizer, seed)
        source = "built-in passage" if texts == [BUILTIN_PASSAGE] else str(DEFAULT_DATA_DIR)
    if tenants:
        shared_prefix_tokens = shared_prefix_tokens or 256
        prefixes = [
            p + "\n"
            for p in build_prompts(default_corpus(), tenants, shared_prefix_tokens - 1, tokenizer, seed=10**6 + 1)
        ]
        rng = random.Random(seed + 7)
        prompts = [rng.choice(prefixes) + p for p in prompts]
    elif shared_prefix_tokens:
        prefix = build_prompts(default_corpus(), 1, shared_prefix_tokens - 1, tokenizer, seed=10**6)[0] + "\n"
        prompts = [prefix + p for p in prompts]
    note = {
        "source": source,
        "count": len(prompts),
        "tokenizer": str(tokenizer_path) if tokenizer else None,
        "shared_prefix_tokens": shared_prefix_tokens,
        "tenants": tenants,
    }
    if tokenizer is not None:
        lengths = [len(tokenizer.encode(p, add_special_tokens=True)) for p in prompts]  # as the server counts them
        note.update(tokens_min=min(lengths), tokens_max=max(lengths), tokens_mean=sum(lengths) / len(lengths))
    else:
        note["approximate_tokens"] = prompt_tokens
    return prompts, note
