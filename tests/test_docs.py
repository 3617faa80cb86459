"""The documentation: the flags page is what the argument parsers generate, every flag is on it, the README's
links lead somewhere, and the site builds with MkDocs' strict checks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250  # a front door: the reference is the docs site


def gen_flags():
    """docs/gen_flags.py, loaded from its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "docs" / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_flags_page_is_what_the_parsers_generate():
    gen = gen_flags()
    committed = gen.PAGE.read_text() if gen.PAGE.is_file() else ""
    assert committed == gen.render(), f"{gen.PAGE.relative_to(ROOT)} is stale: run `make docs` and commit it"


def test_every_option_of_both_server_parsers_is_on_the_flags_page():
    gen = gen_flags()
    page = gen.PAGE.read_text()
    missing = [
        f"{command} {option}"
        for command, parser in gen.parsers()
        for action in parser._actions
        for option in action.option_strings
        if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", page)
    ]
    assert len(gen.parsers()) == 2
    assert not missing, f"options missing from the flags page: {missing}"


def test_the_flags_page_does_not_depend_on_the_environment(monkeypatch):
    """--api-key's default comes from $KVSERVE_API_KEY: the page must never show a key."""
    gen = gen_flags()
    monkeypatch.setenv("KVSERVE_API_KEY", "secret-key-from-the-environment")
    assert "secret-key-from-the-environment" not in gen.render()


def test_every_relative_link_of_the_readme_leads_to_a_file():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in relative)
    broken = [link for link in relative if not (ROOT / link).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"


def test_the_readme_stays_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference belongs in docs/"


def test_the_docs_site_builds_with_strict_checks(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # no banner about MkDocs 2 in a failure's output
    )
    assert out.returncode == 0, out.stdout + out.stderr
