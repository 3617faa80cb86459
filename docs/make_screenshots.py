"""Regenerates the screenshots of the docs' playground page (docs/playground.md): docs/images/playground.png
and attention.png, then race.png and kv-map.png, which the browser test of the race and the map takes itself
(tests/server/test_kv_browser.py, always on the default model).

    .venv/bin/python docs/make_screenshots.py [--checkpoint checkpoints/shakespeare-small] [--only-kv]

Serves the checkpoint on an ephemeral 127.0.0.1 port and drives headless Chromium with the helpers of the
browser test (tests/server/test_playground_browser.py). Needs /usr/bin/chromium and `pip install playwright`.
Without the checkpoint it falls back to a tiny random model and says so: same page, noise for text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model.checkpoint import DEFAULT_CHECKPOINT, save_checkpoint  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.tokenizer import train_tokenizer  # noqa: E402
from server.api.app import create_app  # noqa: E402
from server.engine import Engine, EngineArgs  # noqa: E402
from tests.conftest import TINY_TEXT  # noqa: E402
from tests.server.conftest import LiveServer  # noqa: E402
from tests.server.test_playground_browser import fill_form, generate_to_the_end, launch_chromium, sync_api  # noqa: E402

IMAGES = REPO / "docs" / "images"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def tiny_random_checkpoint() -> Path:
    tokenizer = train_tokenizer([TINY_TEXT], vocab_size=400)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=4,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return save_checkpoint(GPT(config).eval(), tokenizer, Path(tempfile.mkdtemp(prefix="tiny-ckpt-")))


KV_SCREENSHOTS = ("race.png", "kv-map.png")


def kv_screenshots(out: Path) -> None:
    """Runs the race and demo browser tests, which save these screenshots, and copies them to `out`."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "tests/server/test_kv_browser.py", "-k", "race or demo"],
            cwd=REPO,
            env={**os.environ, "KVSERVE_ARTIFACTS": folder},
            check=True,
        )
        for name in KV_SCREENSHOTS:
            shutil.copy(Path(folder) / "playground" / name, out / name)
    print(f"wrote {', '.join(str(out / name) for name in KV_SCREENSHOTS)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--out", type=Path, default=IMAGES)
    ap.add_argument("--only-kv", action="store_true", help="only race.png and kv-map.png")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kv_screenshots(args.out)
    if args.only_kv:
        return 0
    checkpoint, model_name = args.checkpoint, args.checkpoint.name
    if not (checkpoint / "model.safetensors").is_file():
        print(f"warning: no checkpoint at {checkpoint}; using a tiny random model (its text is noise)")
        checkpoint, model_name = tiny_random_checkpoint(), "tiny-random"
    engine_args = EngineArgs(checkpoint=checkpoint, device="cpu")
    server = LiveServer(create_app(lambda: Engine.from_args(engine_args), model_name=model_name)).start()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with sync_api.sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(server.url + "/")
            fill_form(page, PROMPT, decoding="sample", max_new_tokens="48", temperature="0.8", top_k="40", seed="7")
            generate_to_the_end(page)
            page.screenshot(path=str(args.out / "playground.png"))
            page.set_viewport_size({"width": 1280, "height": 2000})  # the whole view on screen: no scrolling
            page.click("#show-attention")
            page.locator("#attention-tokens .tok[data-query='6']").hover()
            page.screenshot(path=str(args.out / "attention.png"), clip=page.locator("#attention").bounding_box())
            browser.close()
    finally:
        server.stop()
    print(f"wrote {args.out / 'playground.png'} and {args.out / 'attention.png'} ({checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
