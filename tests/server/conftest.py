"""Live servers for the HTTP tests: the real app under uvicorn on an ephemeral 127.0.0.1 port."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.engine import Engine, EngineArgs, EngineConfig
from server.engine.block_manager import BlockManager
from server.engine.sampler import Sampler
from tests.conftest import TEST_DEVICE


def wait_healthy(url: str, timeout: float, check_alive=lambda: None) -> None:
    """Polls GET /health until it answers 200; `check_alive` may raise to give up early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"server at {url} did not become healthy in {timeout}s")


class LiveServer:
    def __init__(self, app) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def engine(self) -> Engine:
        return self.app.state.kvserve.engine

    def start(self, timeout: float = 60.0) -> LiveServer:
        self._thread.start()
        wait_healthy(self.url, timeout)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, trust_env=False, **kw)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when absent), matched by name and the given labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def serve(checkpoint, app_kw: dict | None = None, **engine_kw) -> LiveServer:
    """`app_kw` goes to create_app (limits, api_key...), the rest to EngineConfig."""
    args = EngineArgs(checkpoint=checkpoint, device=TEST_DEVICE, config=EngineConfig(threads=1, **engine_kw))
    return LiveServer(create_app(lambda: Engine.from_args(args), **{"model_name": "tiny", **(app_kw or {})})).start()


@pytest.fixture(scope="session")
def live(tiny_checkpoint):
    """The tiny random model, 32 slots."""
    server = serve(tiny_checkpoint, max_num_seqs=32, max_waiting=32)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_live(tiny_checkpoint):
    """One running request and one waiting place: easy to overload."""
    server = serve(tiny_checkpoint, max_num_seqs=1, max_waiting=1)
    yield server
    server.stop()


def sse_events(lines) -> list[dict | str]:
    """The `data:` payloads of a Server-Sent Events stream, JSON-decoded (except [DONE])."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def count_wakeups(loop) -> list:
    """Every callback handed to `loop` from another thread from now on (the engine's wake-ups), in order; the
    loop's own `call_soon_threadsafe` still runs them. For a loop that ends with the test (`asyncio.run`'s)."""
    wakeups = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):
        wakeups.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting
    return wakeups


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Polls until `condition()` holds; fails naming `what` if it never does."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def server_command(checkpoint, port: int, *flags: str) -> list[str]:
    """`python -m server` on the test device with one kernel thread, on 127.0.0.1:port."""
    checkpoint_flags = ["--checkpoint", str(checkpoint), "--port", str(port)]
    return [sys.executable, "-m", "server", *checkpoint_flags, "--device", TEST_DEVICE, "--threads", "1", *flags]


class ServerProcess:
    """`python -m server` as a child process on a free 127.0.0.1 port (for tests of the process itself:
    signals, exit status, memory)."""

    def __init__(self, checkpoint, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = server_command(checkpoint, port, "--log-level", "warning", *flags)
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen(
            cmd, cwd=Path(__file__).parents[2], stdout=self.log, stderr=subprocess.STDOUT, text=True
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_healthy(self, timeout: float = 120.0) -> ServerProcess:
        def alive() -> None:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"

        wait_healthy(self.url, timeout, alive)
        return self

    def rss_bytes(self) -> int:
        """Resident memory of the server process, from /proc (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metric(self, name: str, **labels) -> float:
        return LiveServer.metric(self, name, **labels)  # same parsing, same `url`

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def hook_sampling(monkeypatch, before=None, after=None) -> None:
    """Lets a test see (and break) the runner's sampling: before(requests, logits) may change the (R, V)
    logits in place or raise; after(requests, tokens) may change the (R,) sampled tokens in place (a
    float64 view of the step's results)."""
    real = Sampler.pick

    def pick(self, logits, args):
        if before is not None:
            before(args.requests, logits)
        results = real(self, logits, args)  # (R, 3 + 2K): token, logprob, finite, ...
        if after is not None:
            after(args.requests, results[:, 0])
        return results

    monkeypatch.setattr(Sampler, "pick", pick)


class _SilentHandle:
    """A Ray Serve deployment handle whose replicas are never called."""

    def options(self, **kw) -> _SilentHandle:
        return self


@contextmanager
def ingress_without_replicas(checkpoint: Path) -> Iterator[TestClient]:
    """The cluster's ingress app (the API over a RayEngineClient), loaded, with no Ray and no replica behind
    it: for what the ingress answers by itself."""
    from server.cluster.client import RayEngineClient

    loop = asyncio.new_event_loop()  # the client's own, as the ingress's (its shutdown runs there)
    thread = threading.Thread(target=loop.run_forever, name="ingress-loop", daemon=True)
    thread.start()
    try:
        client = RayEngineClient(_SilentHandle(), EngineArgs(checkpoint=checkpoint), lambda: None, loop)
        with TestClient(create_app(lambda: client, model_name="tiny", warmup=False)) as http:
            wait_for(lambda: http.get("/health").status_code == 200, "the ingress to load")
            yield http
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), loop).result(timeout=10)  # what shutdown left there
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def blocks_free(engine: Engine) -> bool:
    """No request holds a KV-cache block (cached prefixes may remain, unreferenced)."""
    return engine.blocks.num_free_blocks == engine.blocks.num_blocks


def pending_aborts(engine: Engine) -> int:
    """Cancellations the engine took but has not carried out yet (the start of its next step does)."""
    return len(engine.scheduler._aborts)


def check_block_invariants(blocks: BlockManager) -> None:
    """Every block is held or free, never both, and free in one queue, the one its cache entry calls for;
    cached keys point at blocks with that key."""
    free = blocks.free
    queues = [set(free.empty), set(free.probation), set(free.protected)]
    assert sum(map(len, queues)) == len(set().union(*queues)), "a block sits in two free queues"
    assert len(free.protected) <= free.protected_limit, f"{len(free.protected)} protected blocks"
    for block, refs in enumerate(blocks.ref_counts):
        assert refs >= 0, f"block {block} has {refs} references"
        assert (refs == 0) == (block in free), f"block {block}: {refs} references, free={block in free}"
        cached = blocks.block_hash[block] is not None
        assert cached or not blocks.reused[block], f"block {block} is marked reused but caches nothing"
        assert block not in queues[0] or not cached, f"empty block {block} caches {blocks.block_hash[block]}"
        assert block not in queues[1] or cached, f"block {block} is in probation but caches nothing"
        assert block not in queues[2] or blocks.reused[block], f"block {block} is protected but never reused"
        assert not cached or blocks.cached.get(blocks.block_hash[block]) == block, f"block {block}'s key is not cached"
    for key, block in blocks.cached.items():
        assert blocks.block_hash[block] == key, (
            f"block {block} is cached under {key} but keyed {blocks.block_hash[block]}"
        )
