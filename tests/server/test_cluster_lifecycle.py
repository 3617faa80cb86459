"""`python -m server.cluster` as a process on a real local Ray of its own, over its life: what `/health` says
once it starts and when replicas die under the streams they serve, and the drain on SIGTERM, which ends it.
Skipped where Ray is not installed (the `cluster` extra)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")

from bench.tiny_checkpoint import main as make_tiny_checkpoint  # noqa: E402
from tests.server.cluster_http import free_ports, replica_pids  # noqa: E402
from tests.server.conftest import wait_for  # noqa: E402

GRACE_S = 5  # --shutdown-grace
# without the cache every step recomputes the sequence: still generating when a test acts, and past the grace
SLOW = {"max_new_tokens": 900, "ignore_eos": True, "speculative": False, "use_cache": False}


class ClusterProcess:
    """`python -m server.cluster` with two replicas on a local Ray whose files (Serve's logs among them) are
    in a folder of its own."""

    def __init__(self, checkpoint: Path) -> None:
        port = free_ports(2)  # the ingress listens on the first
        self.url = f"http://127.0.0.1:{port}"
        self.ray_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must fit in 107 bytes
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = self.ray_dir
        cmd = [sys.executable, "-m", "server.cluster", "--checkpoint", str(checkpoint), "--port", str(port)]
        cmd += ["--replicas", "2", "--replica-cpus", "0.5", "--threads", "1", "--shutdown-grace", str(GRACE_S)]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd,
            cwd=Path(__file__).parents[2],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its Ray processes in its group, which the teardown can end
        )
        self.first_ok: dict | None = None  # the first 200 answer of /health

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_healthy(self) -> ClusterProcess:
        def healthy() -> bool:
            assert self.proc.poll() is None, f"the cluster exited: {self.output()[-3000:]}"
            try:
                r = httpx.get(self.url + "/health", timeout=5, trust_env=False)
            except httpx.TransportError:
                return False
            if r.status_code == 200:
                self.first_ok = r.json()
            return r.status_code == 200

        wait_for(healthy, "the cluster to answer /health with 200", timeout=300)
        return self

    def serve_log(self, name: str) -> str:
        """Serve's log files `name` (a glob under logs/serve) of this process's Ray session, joined."""
        return "".join(p.read_text() for p in Path(self.ray_dir).glob(f"ray/session_*/logs/serve/{name}"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("lifecycle") / "tiny1024"
    make_tiny_checkpoint([str(checkpoint), "--context", "1024"])
    process = ClusterProcess(checkpoint)
    try:
        yield process.wait_healthy()
    finally:
        process.stop()


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10, trust_env=False)


def start_streams(url: str, count: int, parameters: dict) -> tuple[list[threading.Thread], dict]:
    """`count` streams of fresh prompts (the kv router spreads them over both replicas, least loaded first),
    returned once each has had its first event; `finals` gets each one's last event, or what broke it."""
    started, finals = threading.Semaphore(0), {}

    def run(k: int) -> None:
        body = {"inputs": f"KING {k}: a long tale", "parameters": parameters}
        last = None
        try:
            with httpx.stream("POST", url + "/generate_stream", json=body, timeout=120, trust_env=False) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        if last is None:
                            started.release()
                        last = json.loads(line[5:])
        except httpx.HTTPError as e:  # a stream cut without its last event
            last = {"broken": repr(e)}
        finals[k] = last

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=60), "a stream did not start"
    return threads, finals


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"


def router_replica_ids(url: str) -> set[str]:
    """The replicas the ingress's router may send to (its in-flight gauge has one line per replica)."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    name = "kvserve:router_requests_in_flight{"
    return {line.split('"')[1] for line in text.splitlines() if line.startswith(name)}


def wait_for_replicas(url: str, count: int, without: set[int]) -> None:
    """Until /health counts `count` replicas ready and none of the processes `without` is among them."""

    def ready() -> bool:
        r, pids = health(url), set(replica_pids(url).values())
        counted = r.status_code == 200 and r.json()["replicas_ready"] == count
        return counted and len(pids) == count and not pids & without

    wait_for(ready, f"{count} replicas ready again", timeout=240)


def test_the_first_ok_of_health_counts_a_ready_replica(cluster):
    assert cluster.first_ok is not None and cluster.first_ok["replicas_ready"] >= 1, cluster.first_ok


def test_a_replica_that_dies_under_a_stream_is_not_counted_from_the_streams_error_on(cluster):
    """The ingress learns of the death from the failed stream itself, not from Serve's next look at its
    replicas: the first /health after the stream's error event counts one replica, not two."""
    wait_for_replicas(cluster.url, 2, set())
    pids = replica_pids(cluster.url)
    victim_id, victim = min(pids.items(), key=lambda item: item[1])
    threads, finals = start_streams(cluster.url, 4, SLOW)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: any("error" in f for f in list(finals.values())), "a stream to end with an error")
    r = health(cluster.url)  # at once: the streams on the other replica go on
    assert r.status_code == 200 and r.json()["replicas_ready"] == 1, r.text
    assert victim_id not in router_replica_ids(cluster.url)
    join(threads)
    errors = [f for f in finals.values() if "error" in f]
    assert all("replica" in e["error"] for e in errors), finals
    wait_for_replicas(cluster.url, 2, {victim})  # Serve starts another, which is counted once it runs


def test_with_every_replica_dead_health_is_503_until_one_runs_again(cluster):
    """Never 'ok' with no replica ready: once the streams on both replicas failed, /health answers 503
    (in TGI's error shape) until Serve has started one again."""
    wait_for_replicas(cluster.url, 2, set())
    pids = replica_pids(cluster.url)
    threads, finals = start_streams(cluster.url, 4, SLOW)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    join(threads)
    served = {f.get("error") for f in finals.values()}
    assert all(e is not None and "replica" in e for e in served), finals  # every stream lost its replica
    r = health(cluster.url)
    assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
    assert "no replica is running" in r.json()["error"], r.text
    wait_for_replicas(cluster.url, 2, set(pids.values()))


def test_sigterm_drains_every_stream_to_its_last_event_and_serve_stops_without_force(cluster):
    """As `python -m server` drains: /health and new requests answer 503 at once; every stream still
    generating at the grace's end gets a last event of error_type 'shutdown', the others their final event
    (none is cut without one); Serve then stops its replicas without having to kill them, and the process
    exits 0. (Last: it ends the process.)"""
    wait_for_replicas(cluster.url, 2, set())
    threads, finals = start_streams(cluster.url, 8, SLOW)
    cluster.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: health(cluster.url).status_code == 503, "/health to answer 503", timeout=10)
    refused = httpx.post(cluster.url + "/generate", json={"inputs": "x"}, timeout=30, trust_env=False)
    assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable", refused.text
    join(threads)
    assert len(finals) == 8
    for last in finals.values():  # its own final event (it finished within the grace), or the shutdown event
        assert last.get("generated_text") is not None or last.get("error_type") == "shutdown", finals
    assert any(last.get("error_type") == "shutdown" for last in finals.values()), "no stream outlived the grace"
    assert cluster.proc.wait(GRACE_S + 60) == 0, cluster.output()[-3000:]
    controller = cluster.serve_log("controller_*.log")
    assert "Controller shutdown started" in controller, "Serve's controller log was not found"
    assert "force-killing" not in controller, controller[-3000:]
