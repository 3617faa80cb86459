"""The playground page in a real headless Chromium against a live server: tokens stream in, Stop frees
the slot on the server, the attention view draws and highlights the weights the API returns, and the
JSON-schema box holds the output to a schema.

Needs Debian's `chromium` (/usr/bin/chromium) and the `playwright` Python package; skipped without them.
Screenshots go to $KVSERVE_ARTIFACTS/playground (default: the system temp folder).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import pending_aborts

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)

# Playwright cannot download its own browser here: it drives the system one, offline and quiet.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]  # containers often have a tiny /dev/shm
PROMPT = "To be, or not to be, that is the question"
WAIT_MS = 120_000  # how long a page may take to show something on a busy machine (not a measurement)

sync_api.expect.set_options(timeout=WAIT_MS)
expect = sync_api.expect


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def fill_form(page, prompt: str, **fields: str) -> None:
    """Types the prompt and sets the given controls (`decoding="greedy"`, `max_new_tokens="20"`...)."""
    page.fill("#prompt", prompt)
    for name, value in fields.items():
        if name == "decoding":
            page.select_option("#decoding", value)
        else:
            page.fill(f"#{name}", value)


def generate_to_the_end(page) -> None:
    page.click("#generate")
    expect(page.locator("#status")).to_contain_text("finished")


@contextmanager
def engine_held_after_token(engine, num_tokens: int) -> Iterator[threading.Event]:
    """Holds the engine thread after the step that gives a request its `num_tokens`-th token, until the
    yielded event is set (or the block ends): the page's state can then be checked mid-generation."""
    release = threading.Event()
    step = engine.step

    def held_step():
        batch = step()
        if any(req.num_output_tokens >= num_tokens for req in batch.num_tokens):
            release.wait(WAIT_MS / 1000)
        return batch

    engine.step = held_step
    try:
        yield release
    finally:
        release.set()
        del engine.step


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, live):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(live.url + "/")
    expect(page.locator("#model-info")).to_contain_text("tiny")
    yield page
    page.close()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("KVSERVE_ARTIFACTS", tempfile.gettempdir())) / "playground"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def api_generate(live, **parameters) -> dict:
    r = httpx.post(live.url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_page_and_its_files_are_served(live):
    page = httpx.get(live.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, kind in (
        ("app.js", "javascript"),
        ("sse.js", "javascript"),
        ("attention.js", "javascript"),
        ("style.css", "css"),
    ):
        asset = httpx.get(f"{live.url}/static/{name}", timeout=30)
        assert asset.status_code == 200 and kind in asset.headers["content-type"], name
    assert httpx.get(live.url + "/static/..%2Fplayground.py", timeout=30).status_code == 404


def test_tokens_stream_in_with_live_figures_and_match_the_api(page, live, artifacts):
    fill_form(page, PROMPT, decoding="greedy", max_new_tokens="24")
    with engine_held_after_token(live.engine, 3) as release:
        page.click("#generate")
        expect(page.locator("#token-count")).to_have_text("3")  # three tokens shown, the request still running
        expect(page.locator("#output .token")).to_have_count(3)
        expect(page.locator("#generate")).to_have_text("Stop")
        assert page.locator("#ttft").inner_text() != "–", "no time to first token while streaming"
        release.set()
    expect(page.locator("#status")).to_contain_text("finished")

    expected = api_generate(live, max_new_tokens=24, details=True)
    generated = expected["details"]["generated_tokens"]
    expect(page.locator("#output .token")).to_have_count(generated)
    expect(page.locator("#token-count")).to_have_text(str(generated))
    expect(page.locator("#cache-used")).to_have_text("used")
    expect(page.locator("#generate")).to_have_text("Generate")
    assert "".join(page.locator("#output .token").all_text_contents()) == expected["generated_text"]
    assert page.locator("#tps").inner_text() != "–"
    page.screenshot(path=str(artifacts / "playground.png"), full_page=True)


def test_uncached_generation_reports_the_cache_off(page, live):
    fill_form(page, PROMPT, decoding="greedy", max_new_tokens="5")
    page.uncheck("#use_cache")
    generate_to_the_end(page)
    expect(page.locator("#cache-used")).to_have_text("not used")


def test_stop_disconnects_and_the_server_frees_the_slot(page, live, artifacts):
    aborted_before = live.metric("kvserve:request_success_total", finished_reason="abort")
    fill_form(page, PROMPT, max_new_tokens="100", seed="5")
    with engine_held_after_token(live.engine, 5) as release:
        page.click("#generate")
        expect(page.locator("#token-count")).to_have_text("5")
        page.click("#generate")  # now labelled Stop
        expect(page.locator("#status")).to_have_text("stopped")
        expect(page.locator("#generate")).to_have_text("Generate")
        page.screenshot(path=str(artifacts / "stopped.png"), full_page=True)
        wait_until(lambda: pending_aborts(live.engine) == 1, "the server never saw the disconnect")
        release.set()
    wait_until(
        lambda: live.metric("kvserve:request_success_total", finished_reason="abort") == aborted_before + 1,
        "the abort was not counted in /metrics",
    )
    assert live.metric("kvserve:num_requests_running") == 0
    assert live.metric("kvserve:kv_cache_usage_perc") == 0
    expect(page.locator("#output .token")).to_have_count(5)  # nothing arrived after Stop


def test_attention_view_draws_the_weights_the_api_returns(page, live, artifacts):
    fill_form(page, PROMPT, decoding="greedy", max_new_tokens="16")
    generate_to_the_end(page)
    page.click("#show-attention")
    expect(page.locator("#attention")).to_be_visible()
    config = live.engine.model_config
    expect(page.locator("#layer option")).to_have_count(config.n_layer)
    expect(page.locator("#head option")).to_have_count(config.n_head + 1)  # + average over heads
    assert page.eval_on_selector("#heatmap", "c => c.width > 0 && c.height > 0")
    assert page.eval_on_selector(
        "#heatmap",
        """c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i + 2] > d[i] + 40) return true;
        return false; }""",
    ), "the heat map has no blue cells"

    attention = api_generate(live, max_new_tokens=16, return_attention=True)["details"]["attention"]
    query = 2
    last_layer = attention["weights"][-1]  # the view opens on the last layer, averaged over heads
    expected = [sum(head[query][k] for head in last_layer) / len(last_layer) for k in range(len(attention["tokens"]))]
    hovered = page.locator(f"#attention-tokens .tok[data-query='{query}']")
    hovered.hover()
    expect(hovered).to_have_class("tok generated hovered")
    titles = page.locator("#attention-tokens .tok").evaluate_all("spans => spans.map(s => s.title)")
    shown = [float(t.removeprefix("weight ")) for t in titles]
    assert len(shown) == len(expected)
    assert all(abs(s - e) <= 1e-4 for s, e in zip(shown, expected)), f"highlighted {shown}, API says {expected}"
    assert all(s == 0 for s in shown[attention["query_start"] + query + 1 :]), "a future token lit up"
    page.screenshot(path=str(artifacts / "attention.png"), full_page=True)

    page.select_option("#head", "0")
    hovered.hover()
    first_head = [
        float(t.removeprefix("weight "))
        for t in page.locator("#attention-tokens .tok").evaluate_all("spans => spans.map(s => s.title)")
    ]
    assert all(abs(s - e) <= 1e-4 for s, e in zip(first_head, last_layer[0][query]))


NAME_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}},
    "required": ["name"],
    "additionalProperties": False,
}


def fill_schema(page, text: str) -> None:
    page.click("#schema-box summary")  # the box starts collapsed
    page.fill("#json_schema", text)


def test_json_schema_box_sends_a_grammar_and_the_output_matches(page, live):
    fill_form(page, PROMPT, max_new_tokens="64", temperature="1.5", seed="3")
    fill_schema(page, json.dumps(NAME_SCHEMA))
    with page.expect_request("**/generate_stream") as sent:
        page.click("#generate")
    assert sent.value.post_data_json["parameters"]["grammar"] == {"type": "json", "value": NAME_SCHEMA}
    expect(page.locator("#status")).to_contain_text("finished")
    text = "".join(page.locator("#output .token").all_text_contents())
    output = json.loads(text)
    assert set(output) == {"name"} and isinstance(output["name"], str) and len(output["name"]) <= 8, text
    expect(page.locator("#schema-error")).to_be_hidden()


def test_json_schema_box_refuses_text_that_is_not_json_and_sends_nothing(page, live):
    sent = []
    page.on("request", lambda request: sent.append(request.url) if "/generate" in request.url else None)
    fill_form(page, PROMPT, decoding="greedy", max_new_tokens="8")
    fill_schema(page, '{"type": "object", "properties": ')
    page.click("#generate")
    expect(page.locator("#schema-error")).to_be_visible()
    expect(page.locator("#schema-error")).to_contain_text("not JSON")
    expect(page.locator("#status")).to_have_text("idle")
    expect(page.locator("#generate")).to_have_text("Generate")

    # A schema the server cannot use is its refusal (422), shown like any other error; the box empty again,
    # the request carries no grammar.
    page.fill("#json_schema", '{"type": "no such type"}')
    expect(page.locator("#schema-error")).to_be_hidden()
    page.click("#generate")
    expect(page.locator("#status")).to_contain_text("error: 422")
    assert sent == [live.url + "/generate_stream"], sent
    page.fill("#json_schema", "")
    with page.expect_request("**/generate_stream") as plain:
        generate_to_the_end(page)
    assert "grammar" not in plain.value.post_data_json["parameters"]


def wait_until(condition, message: str, attempts: int = 1200) -> None:
    """Polls a condition of the server's state (each try is an HTTP call or a read; no clock involved)."""
    for _ in range(attempts):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(message)
