"""The Ray Serve app on a real local Ray (`ray.init(num_cpus=2)`): two engine replicas behind the ingress,
against one `python -m server` on the same checkpoint. Skipped where Ray is not installed (the `cluster`
extra, which `make test` installs)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from bench.tiny_checkpoint import main as make_tiny_checkpoint  # noqa: E402
from server.cluster.app import ClusterSettings, build_app  # noqa: E402
from server.cluster.env import direct_ingress_env, own_ray_env  # noqa: E402
from server.engine import EngineConfig  # noqa: E402
from tests.model.family_checkpoints import family_checkpoint  # noqa: E402
from tests.server.cluster_http import (  # noqa: E402
    free_port,
    free_ports,
    metric,
    post,
    replica_pids,
    requests_by_stream,
    stream,
    wait_routes,
)
from tests.server.conftest import serve as serve_single  # noqa: E402
from tests.server.conftest import wait_healthy  # noqa: E402

NUM_BLOCKS = 160  # per replica: a 1024-token sequence needs 64 blocks of 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Long enough (1024 positions) that a stream of hundreds of tokens is still running when a test
    kills its replica."""
    path = tmp_path_factory.mktemp("cluster") / "tiny1024"
    make_tiny_checkpoint([str(path), "--context", "1024"])
    return path


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    """A tiny Qwen3 (grouped-query attention, QK-norm, its chat template and EOS ids; written by transformers,
    so None where transformers is not installed)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    return family_checkpoint("qwen3", tmp_path_factory.mktemp("cluster_qwen3"))


APPS = (  # name, router, replicas, Ray CPUs per replica, engine limits, checkpoint
    ("kv", "kv", 2, 0.4, {}, "tiny"),
    ("rr", "round-robin", 2, 0.4, {}, "tiny"),
    ("small", "kv", 1, 0.2, {"max_num_seqs": 1, "max_waiting": 0}, "tiny"),  # holds one request: the refusals' test
    ("qwen3", "kv", 1, 0.2, {}, "qwen3"),  # a model family other than GPT-2's: the families' test
)
IMBALANCE_THRESHOLD = 4  # under the default (8): the fallback's test has 8 requests in flight at once


@pytest.fixture(scope="module")
def cluster(checkpoint, qwen3_checkpoint):
    """Four apps on one local Ray, as `python -m server.cluster` runs it (Serve's direct ingress: each
    app's ingress replica serves HTTP on its own port): `kv` at /, `round-robin` at /rr, two replicas
    each, `small` at /small, one replica that holds one request, and `qwen3` at /qwen3, one replica of
    a tiny Qwen3 (left out where transformers, which writes it, is not installed). Yields their base URLs
    by name."""
    checkpoints = {"tiny": checkpoint, "qwen3": qwen3_checkpoint}
    apps = [app for app in APPS if checkpoints[app[5]] is not None]
    first = free_ports(len(apps))
    env = {**own_ray_env(), **direct_ingress_env(first, ports=len(apps))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # ray.init hands it to the Ray processes it starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    for name, router, replicas, cpus, limits, model in apps:
        settings = ClusterSettings(
            checkpoint=checkpoints[model],
            replicas=replicas,
            router=router,
            replica_cpus=cpus,
            engine=EngineConfig(threads=1, num_blocks=NUM_BLOCKS, **limits),
            model_name="tiny",
            imbalance_threshold=IMBALANCE_THRESHOLD,
        )
        serve.run(build_app(settings), name=name, route_prefix="/" if name == "kv" else f"/{name}", blocking=False)
    urls = {}
    for port in range(first, first + len(apps)):
        ((prefix, name),) = wait_routes(port, 240).items()
        urls[name] = f"http://127.0.0.1:{port}" + ("" if prefix == "/" else prefix)
    for url in urls.values():
        wait_healthy(url, 240)
    yield urls
    serve.shutdown()
    ray.shutdown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def single(checkpoint):
    server = serve_single(checkpoint, num_blocks=NUM_BLOCKS)
    yield server.url
    server.stop()


def test_two_replicas_answer_what_a_single_server_answers_streamed_and_not(cluster, single):
    cluster = cluster["kv"]
    body = {
        "inputs": "ROMEO: the quick brown",
        "parameters": {"max_new_tokens": 24, "details": True, "decoder_input_details": True},
    }
    one, many = post(single, "/generate", body), post(cluster, "/generate", body)
    assert many["generated_text"] == one["generated_text"]
    assert [t["logprob"] for t in many["details"]["tokens"]] == [t["logprob"] for t in one["details"]["tokens"]]
    streamed = stream(cluster, "/generate_stream", {**body, "parameters": {"max_new_tokens": 24}})
    assert [e["token"]["id"] for e in streamed] == [t["id"] for t in one["details"]["tokens"]]
    assert [e["token"]["logprob"] for e in streamed] == [t["logprob"] for t in one["details"]["tokens"]]
    completion = {"prompt": "JULIET: what light", "max_tokens": 16, "temperature": 0, "logprobs": 2}
    a, b = post(single, "/v1/completions", completion), post(cluster, "/v1/completions", completion)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["logprobs"] == a["choices"][0]["logprobs"]
    chunks = stream(cluster, "/v1/completions", completion | {"stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == a["choices"][0]["text"]
    # copies that do not fit one replica's KV cache: refused by the replica's own check, as the single
    # server refuses them (400 on OpenAI's routes, the request's own field named), not a failed generation
    too_many = {"prompt": "JULIET: what light", "max_tokens": 1000, "n": 3}
    a, b = (httpx.post(u + "/v1/completions", json=too_many, timeout=60, trust_env=False) for u in (single, cluster))
    assert (b.status_code, b.json()) == (a.status_code, a.json()) and a.status_code == 400, b.text
    assert "max_tokens" in b.json()["error"]["message"] and "KV-cache blocks" in b.json()["error"]["message"]


def test_a_qwen3_replica_answers_what_a_single_server_answers_with_its_template_and_context(cluster, qwen3_checkpoint):
    """A Qwen3 checkpoint (grouped-query attention, QK-norm, no BOS, several EOS ids, its own chat template)
    served by a replica: greedy tokens and text, streamed and not, the chat answer through the model's
    template and /info's context length are those of one `python -m server` on the same checkpoint."""
    if "qwen3" not in cluster:
        pytest.skip("transformers, which writes the Qwen3 checkpoint, is not installed")
    url, single = cluster["qwen3"], serve_single(qwen3_checkpoint, num_blocks=NUM_BLOCKS)
    try:
        params = {"max_new_tokens": 20, "ignore_eos": True, "details": True}
        body = {"inputs": "To be, or not to be", "parameters": params}
        one, many = post(single.url, "/generate", body), post(url, "/generate", body)
        ids = [t["id"] for t in one["details"]["tokens"]]
        assert [t["id"] for t in many["details"]["tokens"]] == ids and len(ids) == 20
        assert [t["logprob"] for t in many["details"]["tokens"]] == [t["logprob"] for t in one["details"]["tokens"]]
        assert many["generated_text"] == one["generated_text"]
        streamed = stream(url, "/generate_stream", body)
        assert [e["token"]["id"] for e in streamed] == ids
        assert streamed[-1]["generated_text"] == one["generated_text"]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Whether 'tis nobler?"}]
        chat = {"messages": messages, "max_tokens": 24, "temperature": 0}
        a, b = post(single.url, "/v1/chat/completions", chat), post(url, "/v1/chat/completions", chat)
        assert b["choices"][0]["message"] == a["choices"][0]["message"]
        assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
        assert b["usage"] == a["usage"]
        templated = post(single.url, "/tokenize", {"messages": messages})["tokens"]
        assert post(url, "/tokenize", {"messages": messages})["tokens"] == templated
        assert a["usage"]["prompt_tokens"] == len(templated)
        chunks = stream(url, "/v1/chat/completions", chat | {"stream": True})
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        assert text == a["choices"][0]["message"]["content"]
        info = httpx.get(url + "/info", timeout=10, trust_env=False).json()
        assert info["max_total_tokens"] == 256 == single.app.state.kvserve.engine.context_length  # its config's
        assert info["max_input_tokens"] == httpx.get(single.url + "/info", timeout=10).json()["max_input_tokens"]
    finally:
        single.stop()


def test_text_that_is_not_unicode_is_refused_at_the_ingress_as_one_server_refuses_it(cluster, single):
    """A lone UTF-16 surrogate in a prompt: the same 422/400 naming the field from both, never a 500."""
    for path, raw in (
        ("/tokenize", b'{"prompt": "a\\ud800"}'),
        ("/generate", b'{"inputs": "a\\ud800"}'),
        ("/v1/completions", b'{"prompt": ["x", "a\\ud800"]}'),
    ):
        a, b = (
            httpx.post(u + path, content=raw, headers={"content-type": "application/json"}, timeout=60, trust_env=False)
            for u in (single, cluster["kv"])
        )
        assert (b.status_code, b.json()) == (a.status_code, a.json()) and a.status_code in (400, 422), b.text
        assert "lone UTF-16 surrogate" in b.text, b.text


def test_requests_ride_their_replicas_feed_once_open_and_stream_again_after_it_ended_for_idleness(cluster, single):
    """A replica's feed (every event of this ingress's requests there, one item a step) opens at the first
    request there and carries the next ones; it ends once no request has been on it for FEED_IDLE_S, and
    the next request there comes on its own call and opens it again. The tokens are the same either way."""
    from server.cluster.replica import FEED_IDLE_S

    body = {"inputs": "JULIET: wherefore art", "parameters": {"max_new_tokens": 12, "details": True}}
    one = [t["id"] for t in post(single, "/generate", body)["details"]["tokens"]]
    time.sleep(FEED_IDLE_S + 1.5)  # the feeds the earlier tests opened have ended
    before = requests_by_stream(cluster["kv"])
    for _ in range(4):  # on two replicas, the kv router sends the repeats where the first went
        assert [t["id"] for t in post(cluster["kv"], "/generate", body)["details"]["tokens"]] == one
        time.sleep(0.3)  # its feed attaches
    during = requests_by_stream(cluster["kv"])
    assert during["call"] - before["call"] >= 1 and during["feed"] - before["feed"] >= 2
    time.sleep(FEED_IDLE_S + 1.5)
    streamed = stream(cluster["kv"], "/generate_stream", body)
    assert [e["token"]["id"] for e in streamed] == one
    assert requests_by_stream(cluster["kv"])["call"] == during["call"] + 1


def _tenant_runs(url: str, seed: int) -> list[tuple[int, int]]:
    """Four tenants' prefixes (~200 tokens each), each asked 4 times in shuffled order: (tenant, cached)."""
    rng = random.Random(seed)
    words = "sun moon star tree river stone cloud field".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(90)) + f" tenant{seed}x{t}" for t in range(4)]
    order = [t for t in range(4) for _ in range(4)]
    rng.shuffle(order)
    seen, runs = set(), []
    for i, t in enumerate(order):
        out = post(
            url,
            "/generate",
            {"inputs": f"{prefixes[t]} question {i}:", "parameters": {"max_new_tokens": 2, "details": True}},
        )
        runs.append((t, out["details"]["cached_tokens"], t in seen))
        seen.add(t)
    return runs


def test_kv_routing_sends_every_repeat_to_the_replica_that_computed_it_and_round_robin_does_not(cluster):
    cluster, round_robin = cluster["kv"], cluster["rr"]
    kv = _tenant_runs(cluster, seed=1)
    assert all(cached > 0 for _, cached, repeat in kv if repeat), kv
    rr = _tenant_runs(round_robin, seed=2)
    assert not all(cached > 0 for _, cached, repeat in rr if repeat), rr
    metrics = httpx.get(cluster + "/metrics", timeout=10, trust_env=False).text
    assert 'kvserve:router_decisions_total{policy="kv",outcome="hit"}' in metrics
    deadline = time.monotonic() + 20  # the replicas' counters, summed, as their next reports bring them
    hits = sum(cached for _, cached, _ in kv)
    while metric(cluster, "kvserve:prefix_cache_hits_total") < hits and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(cluster, "kvserve:prefix_cache_hits_total") >= hits
    # the replicas' step histograms, summed likewise: every request took a step of its own or more
    while metric(cluster, "kvserve:step_duration_seconds_count") < len(kv) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(cluster, "kvserve:step_duration_seconds_count") >= len(kv)


def test_kv_routing_falls_back_to_the_least_loaded_replica_past_the_imbalance_threshold(cluster):
    """Eight long requests with one cached prefix at once: past 4 (the threshold set here) in flight on the replica
    holding it, the router sends the next to the other replica, which has never seen the prefix."""
    url = cluster["kv"]
    prefix = " ".join(["lantern harbour"] * 60) + " fallback"
    post(url, "/generate", {"inputs": prefix + " 0", "parameters": {"max_new_tokens": 2}})  # one replica caches it
    before = metric(url, 'kvserve:router_decisions_total{policy="kv",outcome="fallback"}')
    cached: list[int] = []

    def run(i: int) -> None:
        out = post(
            url,
            "/generate",
            {
                "inputs": f"{prefix} {i}",
                "parameters": {"max_new_tokens": 300, "ignore_eos": True, "details": True, "speculative": False},
            },
        )
        cached.append(out["details"]["cached_tokens"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(cached) == 8, cached
    assert metric(url, 'kvserve:router_decisions_total{policy="kv",outcome="fallback"}') > before
    assert any(c > 0 for c in cached), f"no request went to the replica caching the prefix: {cached}"
    assert any(c == 0 for c in cached), f"every request went to the replica caching the prefix: {cached}"


def test_a_full_replica_answers_429_as_a_single_server_does(cluster):
    """`small` holds one request (1 running, 0 waiting); Serve offers it one more (the feed's place, which a
    request takes while no feed does, and waits in the replica for room) and queues max(1, max_waiting) + 1
    = 2 more in front of it (one for a feed waiting there). Two copies of a prompt can never fit a replica:
    400, naming the flags (a 429 would invite retries that never succeed). Refused by Serve (its queue
    full): 429."""
    url = cluster["small"]
    r = httpx.post(
        url + "/v1/completions", json={"prompt": "two copies", "max_tokens": 4, "n": 2}, timeout=60, trust_env=False
    )
    assert r.status_code == 400 and "holds at most 1 (--max-num-seqs + --max-waiting)" in r.text, r.text
    assert "retry-after" not in r.headers
    long = {"inputs": "a long one", "parameters": {"max_new_tokens": 1000, "ignore_eos": True, "speculative": False}}
    stop = threading.Event()

    def keep_busy() -> None:  # long streams, one after another: the replica's place and Serve's queue stay taken
        while not stop.is_set():
            with httpx.stream("POST", url + "/generate_stream", json=long, timeout=120, trust_env=False) as r:
                if r.status_code != 200:
                    time.sleep(0.05)
                    continue
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    busy = [threading.Thread(target=keep_busy) for _ in range(4)]
    for t in busy:
        t.start()
    try:
        for path in ("/generate", "/generate_stream"):
            probe = {"inputs": "one more", "parameters": {"max_new_tokens": 1}}
            deadline, statuses = time.monotonic() + 60, []
            while time.monotonic() < deadline:
                r = httpx.post(url + path, json=probe, timeout=60, trust_env=False)
                statuses.append(r.status_code)
                if r.status_code == 429:
                    assert r.json()["error_type"] == "overloaded"
                    break
            assert statuses[-1] == 429, f"{path}: no 429 while the replica and Serve's queue were full: {statuses}"
    finally:
        stop.set()
        for t in busy:
            t.join(120)
    assert post(url, "/generate", {"inputs": "afterwards", "parameters": {"max_new_tokens": 2}})["generated_text"]


def test_a_request_no_replica_takes_ends_at_its_deadline_and_the_router_counts_nothing_left_in_flight(cluster):
    """`small` busy with long streams: a request with `parameters.timeout` waits in Serve's queue, or is
    refused there (429), and at its deadline answers 504 instead of waiting for the replica. Once the
    streams end, the router counts no request in flight anywhere: not the ones cancelled in Serve's
    queue before any replica took them, nor the refused ones."""
    url = cluster["small"]
    # uncached, each step recomputes the whole sequence: seconds on the replica (400 tokens took 0.7 s on a
    # fast core, 900 about 3 s), past any probe's deadline
    long = {
        "inputs": "a long one",
        "parameters": {"max_new_tokens": 900, "ignore_eos": True, "speculative": False, "use_cache": False},
    }
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            with httpx.stream("POST", url + "/generate_stream", json=long, timeout=120, trust_env=False) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    busy = threading.Thread(target=keep_busy)
    busy.start()
    statuses = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "queued past its deadline" not in statuses:
            r = httpx.post(
                url + "/generate",
                json={"inputs": "queued", "parameters": {"max_new_tokens": 1, "timeout": 1.0}},
                timeout=30,
                trust_env=False,
            )
            assert r.status_code in (200, 429, 504), r.text
            if r.status_code == 504:  # queued until its deadline, or taken just before it and cut short
                assert r.json()["error_type"] == "timeout", r.text
            statuses.append("queued past its deadline" if "no replica took" in r.text else r.status_code)
    finally:
        stop.set()
        busy.join(120)
    assert "queued past its deadline" in statuses, f"none timed out in Serve's queue: {Counter(statuses)}"
    in_flight = "kvserve:router_requests_in_flight{"
    for _ in range(100):  # the last stream's end reaches the router a moment after the client
        counts = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(url + "/metrics", timeout=10, trust_env=False).text.splitlines()
            if line.startswith(in_flight)
        ]
        if counts and not any(counts):
            break
        time.sleep(0.1)
    assert counts == [0.0], f"the router still counts requests in flight: {counts}"


def test_a_client_that_leaves_as_its_request_is_taken_leaves_the_feed_it_opened_to_the_next_requests(cluster):
    """The feed that a request's `Taken` asks for is no child of that request in Serve, which cancels a
    leaving request's children: the client leaves at its first event, while the feed is still being
    attached, and the next request there rides that feed; a stream on it runs to its end."""
    from server.cluster.replica import FEED_IDLE_S

    url = cluster["kv"]
    tenant = "NURSE: " + "the tale of the day " * 6  # full blocks: the second request goes where the first went
    params = {"max_new_tokens": 300, "ignore_eos": True, "speculative": False}
    time.sleep(FEED_IDLE_S + 1.5)  # the earlier tests' feeds have ended: the first request below opens one
    before = requests_by_stream(url)
    with httpx.stream(
        "POST",
        url + "/generate_stream",
        json={"inputs": tenant + " A", "parameters": params},
        timeout=120,
        trust_env=False,
    ) as first:
        next(line for line in first.iter_lines() if line.startswith("data:"))
        first.close()  # the client leaves
    time.sleep(1.0)  # the feed attaches (it would end after FEED_IDLE_S with no request on it)
    events = stream(url, "/generate_stream", {"inputs": tenant + " B", "parameters": params | {"details": True}})
    assert "error" not in events[-1] and events[-1]["details"]["generated_tokens"] == 300, events[-1]
    assert requests_by_stream(url)["feed"] - before["feed"] == 1, "the second request did not ride the feed"


def test_a_killed_replica_ends_its_streams_with_an_error_new_requests_succeed_and_ray_restarts_it(cluster):
    cluster = cluster["kv"]
    deadline = time.monotonic() + 30
    while len(pids := replica_pids(cluster)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(pids) == 2, pids
    victim = sorted(pids.values())[0]
    body = {
        "inputs": "KING: a long tale",
        "parameters": {"max_new_tokens": 900, "ignore_eos": True, "speculative": False},
    }  # still running at the kill
    started, finals = threading.Semaphore(0), []

    def run(prompt: str) -> None:
        last = None
        with httpx.stream(
            "POST", cluster + "/generate_stream", json=body | {"inputs": prompt}, timeout=120, trust_env=False
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    if last is None:
                        started.release()
                    last = json.loads(line[5:])
        finals.append(last)

    # four fresh prompts at once: the kv router spreads them over both replicas (least loaded first)
    threads = [threading.Thread(target=run, args=(f"KING {k}: a long tale",)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60), "a stream did not start"
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    assert len(finals) == 4
    errors = [f for f in finals if "error" in f]
    done = [f for f in finals if f.get("details", {}) or f.get("generated_text")]
    assert errors, f"no stream ended with an error after the kill: {finals}"
    assert all("replica" in e["error"] for e in errors), errors
    assert len(errors) + len(done) == 4, finals
    for k in range(3):  # new requests succeed (Ray retries those it had sent to the dead replica)
        post(cluster, "/generate", {"inputs": f"after the kill {k}", "parameters": {"max_new_tokens": 4}})
    deadline = time.monotonic() + 180  # a new replica loads the model and warms up
    while time.monotonic() < deadline:
        pids = replica_pids(cluster)
        health = httpx.get(cluster + "/health", timeout=10, trust_env=False).json()
        if len(pids) == 2 and victim not in pids.values() and health.get("replicas_ready") == 2:
            break
        time.sleep(1)
    assert victim not in pids.values() and len(pids) == 2, f"Ray did not bring the replica back: {pids}"
    assert health["replicas_ready"] == 2, health


def test_the_ingress_drains_before_serve_stops_as_the_command_asks_it_to(cluster):
    """`python -m server.cluster`'s SIGTERM calls the ingress's `begin_shutdown` through the app's handle
    before Serve stops: /health and new requests answer 503 at once, and a stream in flight runs to its end
    before the call returns. (Last: the app stays shut.)"""
    url, started, finals = cluster["small"], threading.Event(), []
    body = {"inputs": "KING: a tale", "parameters": {"max_new_tokens": 300, "ignore_eos": True, "speculative": False}}

    def run() -> None:
        last = None
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120, trust_env=False) as r:
            for line in (line for line in r.iter_lines() if line.startswith("data:")):
                last = json.loads(line[5:])
                started.set()
        finals.append(last)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60), "the stream did not start"
    drained = serve.get_app_handle("small").begin_shutdown.remote()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health", timeout=10, trust_env=False).status_code != 503:
        assert time.monotonic() < deadline, "/health did not turn to 503"
        time.sleep(0.05)
    refused = httpx.post(url + "/generate", json={"inputs": "x"}, timeout=30, trust_env=False)
    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable", refused.text
    drained.result(timeout_s=60)
    thread.join(60)
    assert "error" not in finals[0] and finals[0]["details"]["generated_tokens"] == 300, finals[0]
