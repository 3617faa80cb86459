"""The README's examples, run as written against `python -m server` on the default checkpoint: the streaming
`curl` command and the `openai` client script, each compared with the output the README shows under it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXACT
from tests.server.conftest import ServerProcess

README = Path(__file__).parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"  # where the README's examples send their requests
ELIDED = "{...}}"  # how the README shortens the end of a streamed event
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def readme_example(marker: str) -> tuple[str, str]:
    """The README's fenced code block that contains `marker`, and the ```text block after it (its output)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(), flags=re.M | re.S)
    for i, (_, body) in enumerate(blocks):
        if marker in body:
            assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", f"no ```text output after the {marker!r} block"
            return body, blocks[i + 1][1]
    raise AssertionError(f"README.md has no code block containing {marker!r}")


def run_against(server: ServerProcess, argv: list[str]) -> str:
    """stdout of `argv`, the README's URL pointed at `server`, with no proxy between them."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
    argv = [arg.replace(README_URL, server.url) for arg in argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, f"{argv[0]} exited {out.returncode}: {out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def readme_server(default_checkpoint):
    """`python -m server` on the default checkpoint, served under its directory's name, as `make serve` serves it."""
    server = ServerProcess(default_checkpoint).wait_healthy()
    yield server
    server.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readme_curl_example_streams_the_events_the_readme_shows(readme_server):
    command, shown = readme_example("curl -N")
    assert README_URL in command
    streamed = [line for line in run_against(readme_server, ["bash", "-c", command]).splitlines() if line]
    events = [json.loads(line.removeprefix("data:")) for line in streamed]
    max_new_tokens = json.loads(re.search(r"-d '(.*)'", command).group(1))["parameters"]["max_new_tokens"]
    assert [e["index"] for e in events] == list(range(1, max_new_tokens + 1))
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"
    if not EXACT:
        return  # other kernels sample other tokens: the README shows the exact kernels' output
    shown_events = [line for line in shown.splitlines() if line.startswith("data:")]
    assert len(shown_events) >= 3
    for line in shown_events:
        if line.endswith(ELIDED):
            prefix = line.removesuffix(ELIDED)
            assert any(s.startswith(prefix) for s in streamed), f"no streamed event begins as the README's:\n{line}"
        else:
            assert line in streamed, f"the README's event was not streamed:\n{line}\nstreamed:\n" + "\n".join(streamed)


def test_the_readme_openai_example_prints_what_the_readme_shows(readme_server):
    pytest.importorskip("openai")
    script, shown = readme_example("from openai import OpenAI")
    assert README_URL in script
    printed = run_against(readme_server, [sys.executable, "-c", script])
    if EXACT:
        assert printed == shown
    else:
        assert printed.strip(), "the example printed no text"
