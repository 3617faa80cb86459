"""The race and the KV-block map in a real headless Chromium, against the default model served with a
small pool (64 blocks of 16 tokens), so that the uncached lane's climb and the demo's eviction and
preemption happen in a few seconds. Screenshots: race.png and kv-map.png in $KVSERVE_ARTIFACTS/playground
(docs/make_screenshots.py runs these same tests into docs/images/ for the docs' playground page).

Same needs as test_playground_browser.py (Debian's chromium, the playwright package); skipped without them.
"""

from __future__ import annotations

import httpx
import pytest

from model.checkpoint import DEFAULT_CHECKPOINT
from server.api.app import create_app
from server.engine import Engine, EngineArgs, EngineConfig
from tests.conftest import TEST_DEVICE
from tests.server.conftest import LiveServer, wait_for
from tests.server.step_gate import step_gate
from tests.server.test_playground_browser import artifacts, browser, expect  # noqa: F401 - fixtures

RACE_PROMPT = "KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer by this sun of York;\n"
RACE_TOKENS = 96
MAP_PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?"


@pytest.fixture(scope="module")
def pool_live(default_checkpoint):
    """The default model, under its own name (the screenshots show it); a pool of 64 blocks (two full
    contexts), up to 16 requests at once."""
    args = EngineArgs(
        checkpoint=default_checkpoint,
        device=TEST_DEVICE,
        config=EngineConfig(threads=1, num_blocks=64, max_num_seqs=16),
    )
    server = LiveServer(create_app(lambda: Engine.from_args(args), model_name=default_checkpoint.name)).start()
    yield server
    server.stop()


@pytest.fixture
def open_tab(browser, pool_live):  # noqa: F811
    """Opens the playground at a tab (#race, #kv); every page is closed after the test, so that no map
    keeps a stream open that the server's stop would wait for."""
    pages = []

    def open_(tab: str):
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        pages.append(page)
        page.goto(f"{pool_live.url}/#{tab}")
        expect(page.locator("#model-info")).to_contain_text(DEFAULT_CHECKPOINT.name)
        return page

    yield open_
    for page in pages:
        page.close()


def sharing_moment(scheduler) -> bool:
    """The demo's first step with all four requests running and past their first tokens. Until the
    three others arrive, the first waits after its second token (the browser sends them once it sees
    the first token, and a fast engine could otherwise finish it before they come)."""
    running = scheduler.running
    if len(running) < 4:
        return scheduler.num_waiting == 0 and any(r.num_output_tokens >= 2 for r in running)
    return all(r.num_output_tokens >= 3 for r in running)


def lane_texts(page) -> dict[str, str]:
    return {
        name: "".join(page.locator(f"#lane-{name} .lane-text .token").all_text_contents())
        for name in ("cached", "uncached", "prefix")
    }


def test_the_race_ends_with_identical_texts_and_a_point_per_token_in_every_lane(open_tab, pool_live, artifacts):  # noqa: F811
    page = open_tab("race")
    page.fill("#race-prompt", RACE_PROMPT)
    page.fill("#race-tokens", str(RACE_TOKENS))
    page.click("#race-start")
    expect(page.locator("#race-verdict")).to_have_attribute("data-identical", "true")
    expect(page.locator("#race-verdict")).to_contain_text("identical")
    page.screenshot(path=str(artifacts / "race.png"), full_page=True)

    texts = lane_texts(page)
    api = httpx.post(
        pool_live.url + "/generate",
        timeout=120,
        json={"inputs": RACE_PROMPT, "parameters": {"max_new_tokens": RACE_TOKENS, "ignore_eos": True}},
    ).json()
    assert texts == dict.fromkeys(texts, api["generated_text"]), "a lane's text is not the API's greedy text"
    for lane in ("cached", "uncached", "prefix"):
        expect(page.locator(f"#lane-{lane} [data-figure=tokens]")).to_have_text(str(RACE_TOKENS))
        indices = page.locator(f"#itl-chart circle.point.{lane}").evaluate_all("ps => ps.map(p => +p.dataset.index)")
        assert indices == list(range(1, RACE_TOKENS + 1)), f"the {lane} lane's chart has not one point per token"
    assert int(page.locator("#lane-prefix [data-figure=cached]").inner_text()) > 0, "the prefix lane hit nothing"
    assert page.locator("#lane-cached [data-figure=cached]").inner_text() == "0", "the cached lane did not start cold"


def test_the_map_shows_held_blocks_during_a_request_and_cached_blocks_after(open_tab, pool_live):
    page = open_tab("kv")
    expect(page.locator("#kv-status")).to_have_text("live")
    cells = page.locator("#kv-map .cell")
    expect(cells).to_have_count(64)
    client = pool_live.client()
    body = {"inputs": MAP_PROMPT, "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
    with step_gate(pool_live.engine) as gate:
        gate.at = 20
        with client.stream("POST", "/generate_stream", json=body) as response:
            gate.wait_held("the 20th token")
            view = client.get("/kv").json()
            (request,) = view["requests"]
            assert view["held_blocks"] == len(request["blocks"]) > 0
            held = page.locator("#kv-map .cell.held")
            expect(held).to_have_count(view["held_blocks"])
            assert sorted(int(b) for b in held.evaluate_all("cs => cs.map(c => c.dataset.block)")) == sorted(
                request["blocks"]
            ), "the map colours other blocks than the request holds"
            expect(page.locator("#kv-requests li")).to_have_count(1)
            expect(page.locator("#kv-held")).to_have_text(str(view["held_blocks"]))
            gate.at = None
            for _ in response.iter_lines():
                pass
    wait_for(lambda: pool_live.engine.num_running == 0, "the request to end")
    view = client.get("/kv").json()
    assert view["held_blocks"] == 0 and view["cached_blocks"] > 0
    expect(page.locator("#kv-map .cell.held")).to_have_count(0)
    expect(page.locator("#kv-map .cell.cached")).to_have_count(view["cached_blocks"])
    expect(page.locator("#kv-requests li")).to_have_count(0)


def test_the_guided_demo_shows_sharing_hits_a_cancellation_eviction_and_preemption(open_tab, pool_live, artifacts):  # noqa: F811
    page = open_tab("kv")
    expect(page.locator("#kv-status")).to_have_text("live")
    with step_gate(pool_live.engine) as gate:
        gate.hold_when(sharing_moment)
        page.click("#demo-start")
        gate.wait_held("the demo's four requests running at once")
        expect(page.locator("#kv-map .cell.shared")).not_to_have_count(0)
        expect(page.locator("#kv-requests li")).to_have_count(4)
        bottom = page.locator("#kv-requests").bounding_box()
        page.screenshot(
            path=str(artifacts / "kv-map.png"),
            clip={"x": 0, "y": 0, "width": 1280, "height": bottom["y"] + bottom["height"] + 16},
        )
        gate.hold_when(None)
        expect(page.locator("#demo-status")).to_have_text("done")
    steps = page.locator("#demo-steps li").evaluate_all("items => items.map(i => ({...i.dataset}))")
    assert len(steps) == 3, steps
    sharing, cancellation, flood = steps
    assert int(sharing["hitTokens"]) > 0 and int(sharing["mostHolders"]) == 4, sharing
    assert int(cancellation["hitTokens"]) > 0 and cancellation["cancelledAfter"] == "8", cancellation
    assert int(flood["evictions"]) > 0 and int(flood["preemptions"]) > 0, flood
    view = httpx.get(pool_live.url + "/kv", timeout=30).json()
    expect(page.locator("#kv-evictions")).to_have_text(str(view["evictions"]))
    expect(page.locator("#kv-preemptions")).to_have_text(str(view["preemptions"]))


def test_the_playground_links_to_the_race_and_the_map(open_tab, pool_live):
    page = open_tab("")
    expect(page.locator("#tab-generate")).to_be_visible()
    page.click("nav a[data-tab=race]")
    expect(page.locator("#tab-race")).to_be_visible()
    expect(page.locator("#tab-generate")).to_be_hidden()
    page.click("nav a[data-tab=kv]")
    expect(page.locator("#tab-kv")).to_be_visible()
    expect(page.locator("#kv-status")).to_have_text("live")
    page.click("nav a[data-tab=generate]")
    expect(page.locator("#tab-kv")).to_be_hidden()
    watch = pool_live.app.state.kv_watch
    wait_for(lambda: watch._task is None, "the server's snapshot loop to stop when the map's tab closed")
