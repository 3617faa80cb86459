"""The files a new user meets before any code runs: the Makefile's torch index, the README's commands,
the package metadata."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_takes_a_torch_index_and_passes_none_by_default():
    def torch_line(*assignments: str) -> str:
        out = subprocess.run(
            ["make", "-n", "-B", "install", *assignments], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return next(line for line in out.splitlines() if '"torch==' in line)

    assert "--index-url" not in torch_line()
    cpu = "https://download.pytorch.org/whl/cpu"
    assert torch_line(f"TORCH_INDEX={cpu}").endswith(f'--index-url "{cpu}"')


def make_dry_run(target: str) -> list[str]:
    """The commands `make TARGET` would run, in order (`make -n`: none of them runs)."""
    # --no-print-directory: under an outer make (CI's `make test`), make would add "Entering directory" lines
    command = ["make", "-n", "--no-print-directory", target]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_readmes_two_commands_run_what_it_says():
    readme = (ROOT / "README.md").read_text()
    serve = re.search(r"^make serve +# .*? on (http://[\w.]+:\d+)$", readme, flags=re.M)
    test = re.search(r"^make test +# .*runs lint, the docs build and the whole test suite$", readme, flags=re.M)
    assert serve and test, "the README's `make serve` and `make test` lines changed: update this test with them"
    host, port = serve.group(1).removeprefix("http://").split(":")
    assert make_dry_run("serve")[-1].endswith(
        f"-m server --checkpoint checkpoints/shakespeare-small --host {host} --port {port}"
    )
    steps = make_dry_run("test")
    order = [
        next((i for i, line in enumerate(steps) if marker in line), None)
        for marker in ("ruff check", "mkdocs build --strict", "-m pytest")
    ]
    assert None not in order and order == sorted(order), f"make test should lint, build the docs, then test: {steps}"


def test_the_readme_and_the_docs_never_pipe_into_a_bare_python():
    """Stock Debian has python3 and no `python`."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bare = [
        f"{page.relative_to(ROOT)}: {line}"
        for page in pages
        for line in page.read_text().splitlines()
        if re.search(r"\|\s*python\s", line)
    ]
    assert len(pages) > 1 and not bare, bare


def test_building_the_package_metadata_raises_no_setuptools_warning(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)
    script = (
        "import warnings\nfrom setuptools import build_meta\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    build_meta.prepare_metadata_for_build_wheel('meta')\n"
        "print('WARNINGS:', [str(w.message).splitlines()[0] for w in caught])\n"
    )
    (tmp_path / "meta").mkdir()
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "WARNINGS: []" in out.stdout, out.stdout + out.stderr
