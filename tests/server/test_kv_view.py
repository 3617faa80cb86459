"""The KV view: `kv_snapshot` on a block pool; `GET /kv` against the block manager itself through a
request's life and a cancellation; the stream of snapshots and its one loop; the API key."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from model.sampling import SamplingParams
from server.engine.block_manager import BlockManager
from server.engine.kv_view import kv_snapshot
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from server.engine.step_budget import StepBudget
from tests.server.conftest import ingress_without_replicas, pending_aborts, serve, wait_for
from tests.server.step_gate import step_gate

KEY = "kv-view-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "To be, or not to be, that is the question"
BLOCK = 8


@pytest.fixture(scope="module")
def kv_live(tiny_checkpoint):
    """A small pool (24 blocks of 8 tokens) behind an API key."""
    server = serve(tiny_checkpoint, app_kw={"api_key": KEY}, num_blocks=24, block_size=BLOCK, max_num_seqs=4)
    yield server
    server.stop()


def step_all(bm: BlockManager, sched: Scheduler) -> None:
    """One schedule, with every scheduled token computed (what the engine's update does to the pool)."""
    for req, n in sched.schedule().num_tokens.items():
        req.num_computed += n
        bm.register_full_blocks(req)


def test_a_snapshot_shows_shared_blocks_hits_and_evictions():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, StepBudget(64), max_num_seqs=4, max_waiting=4)
    new = lambda tokens: Request(list(tokens), SamplingParams(temperature=0), seed=0, sink=lambda o: None)  # noqa: E731
    a = new(range(9))
    sched.add_all([a])
    step_all(bm, sched)
    b = new(list(range(8)) + [77])  # its first two blocks are a's
    sched.add_all([b])
    step_all(bm, sched)
    snap = kv_snapshot(bm, sched)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared
    assert [snap.ref_counts[x] for x in shared] == [2, 2] and [snap.hit_counts[x] for x in shared] == [1, 1]
    assert (snap.held_blocks, snap.cached_blocks, snap.free_blocks) == (4, 0, 2)
    assert [(r.request_id, r.blocks, r.cached_tokens) for r in snap.requests] == [
        (a.request_id, a.block_ids, 0),
        (b.request_id, b.block_ids, 8),
    ]
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (18, 8)

    sched.finish(a)
    sched.finish(b)
    snap = kv_snapshot(bm, sched)
    assert (snap.held_blocks, snap.cached_blocks, snap.free_blocks, snap.requests) == (0, 2, 4, [])
    assert sorted(snap.cached_lru) == sorted(shared)
    sched.add_all([new(range(100, 124))])  # six blocks: both cached ones are taken
    step_all(bm, sched)
    snap = kv_snapshot(bm, sched)
    assert (snap.held_blocks, snap.cached_blocks, snap.evictions) == (6, 0, 2)


def expected_view(engine) -> dict:
    """What GET /kv must say, read from the block manager and the scheduler directly (the engine held)."""
    bm = engine.blocks
    held = sum(1 for refs in bm.ref_counts if refs > 0)
    cached = [b for b in bm.free if bm.block_hash[b] is not None]
    return {
        "num_blocks": bm.num_blocks,
        "block_size": bm.block_size,
        "held_blocks": held,
        "cached_blocks": len(cached),
        "free_blocks": bm.num_blocks - held - len(cached),
        "ref_counts": list(bm.ref_counts),
        "cached_lru": cached,
        "hit_counts": list(bm.hit_counts),
        "evictions": bm.evictions,
        "holdings": {r.request_id: list(r.block_ids) for r in engine.scheduler.running},
    }


def check_view(client: httpx.Client, engine, when: str) -> dict:
    view = client.get("/kv").json()
    seen = {k: view[k] for k in expected_view(engine) if k != "holdings"}
    seen["holdings"] = {r["request_id"]: r["blocks"] for r in view["requests"]}
    assert seen == expected_view(engine), f"GET /kv differs from the block manager {when}"
    assert view["free_blocks"] + view["held_blocks"] + view["cached_blocks"] == view["num_blocks"]
    listed = Counter(b for r in view["requests"] for b in r["blocks"])
    assert all(view["ref_counts"][b] == listed[b] for b in range(view["num_blocks"])), f"ref counts {when}"
    return view


def test_get_kv_matches_the_block_manager_through_a_request_and_a_cancellation(kv_live):
    engine, client = kv_live.engine, kv_live.client(headers=AUTH)
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 20, "ignore_eos": True}}
    before = check_view(client, engine, "before the request")
    with step_gate(engine) as gate:
        gate.at = 1
        with client.stream("POST", "/generate_stream", json=body) as response:
            gate.wait_held("the first token")
            view = check_view(client, engine, "after the first token")
            (req,) = view["requests"]
            assert len(req["blocks"]) == -(-(prompt_len + 1) // BLOCK) and req["num_tokens"] == prompt_len + 1
            gate.at = 12
            gate.wait_held("the 12th token")
            view = check_view(client, engine, "at the 12th token")
            assert view["requests"][0]["num_tokens"] == prompt_len + 12
            gate.at = None
            assert sum(1 for line in response.iter_lines() if line.startswith("data:")) == 20
        wait_for(lambda: engine.num_running == 0, "the request to end")
        after = check_view(client, engine, "after the request")
        assert after["held_blocks"] == 0 and after["requests"] == []
        assert after["cached_blocks"] == before["cached_blocks"] + (prompt_len + 20 - 1) // BLOCK, (
            "every full block the request computed should be cached once it ended"
        )

        gate.at = 4  # the same prompt again: its full prompt blocks are hits; then it is cancelled
        with client.stream("POST", "/generate_stream", json=body) as response:
            gate.wait_held("the 4th token of the second request")
            view = check_view(client, engine, "while the second request runs")
            (req,) = view["requests"]
            hits = req["blocks"][: (prompt_len - 1) // BLOCK]
            assert req["cached_tokens"] == len(hits) * BLOCK > 0
            assert all(view["hit_counts"][b] == after["hit_counts"][b] + 1 for b in hits)
        wait_for(lambda: pending_aborts(engine) == 1, "the server to see the client leave")
        check_view(client, engine, "with the cancellation pending")
        gate.at = None
        wait_for(lambda: engine.num_running == 0, "the cancellation to free the request's blocks")
        view = check_view(client, engine, "after the cancellation")
        assert view["held_blocks"] == 0 and view["requests"] == []


def sse_snapshots(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield json.loads(line[5:])


def test_the_stream_sends_the_pool_then_its_changes_and_stops_with_its_last_watcher(kv_live):
    client = kv_live.client(headers=AUTH)
    with client.stream("GET", "/kv/stream") as one, client.stream("GET", "/kv/stream") as two:
        assert one.headers["content-type"].startswith("text/event-stream")
        events_one, events_two = sse_snapshots(one), sse_snapshots(two)  # (a closed iterator closes its stream)
        first, also_first = next(events_one), next(events_two)
        assert first == also_first == client.get("/kv").json()
        watch = kv_live.app.state.kv_watch
        assert len(watch._queues) == 2, "both watchers should share the app's one snapshot loop"
        r = client.post("/generate", json={"inputs": "Whether 'tis nobler", "parameters": {"max_new_tokens": 9}})
        assert r.status_code == 200
        changed = next(events_one)
        assert changed != first and changed["num_blocks"] == first["num_blocks"]
    wait_for(lambda: watch._task is None and not watch._queues, "the snapshot loop to stop once no one watches")


@pytest.mark.parametrize("path", ["/kv", "/kv/stream"])
def test_the_kv_view_needs_the_api_key(kv_live, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(kv_live.url + path, headers=headers, timeout=30)
        assert r.status_code == 401, f"{path} answered {r.status_code} with {headers or 'no key'}"
        assert r.headers["www-authenticate"] == "Bearer"
    with kv_live.client(headers=AUTH).stream("GET", path) as r:
        assert r.status_code == 200, f"{path} refused the right key"


def test_behind_the_cluster_ingress_the_view_is_refused_with_a_422(tiny_checkpoint):
    with ingress_without_replicas(tiny_checkpoint) as http:
        for path in ("/kv", "/kv/stream"):
            r = http.get(path)
            assert r.status_code == 422, (path, r.status_code, r.text)
            assert r.json() == {
                "error": "the KV-cache view needs the engine in this process (python -m server), not behind the "
                "cluster's ingress",
                "error_type": "validation",
            }
