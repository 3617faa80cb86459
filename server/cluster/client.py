"""The ingress's engine client: what `server/api/` asks of an engine (submit, submit_copies, abort, the
tokenizer and the model's config), carried out by the replicas through a Ray Serve deployment handle.

Each submitted prompt is one streaming call to a replica, chosen by the request router
(`ray_router.py`). The call's first item says the replica's engine took the prompt (`admitted` waits for
it); a refusal comes instead as the call's exception, and `admitted` raises it as the local engine's
`submit` would: QueueFullError for a full engine queue, or when Serve's own queue in front of the
replicas is full (every replica at `max_ongoing_requests`), EngineStoppedError for a replica shutting
down. That item (`Taken`) also names the stream the request's events ride: the replica's feed (feeds.py:
one stream from each replica for all of this ingress's requests there, a step at a time) or the call
itself; they are handed to the request's sinks as they come. Faults:
- a call that fails before its first event (the replica died before it produced a token), or whose feed
  ended before any of its events came, is sent again, up to `RETRIES` times, with request ids of its own
  and naming the broken feeds, and the router places it on a live replica;
- a call that fails later, or whose feed ends later, ends each of its requests with an error event,
  never a hang;
- `abort` cancels the call: Ray cancels the replica's generator, which aborts the engine request, and
  the request ends here with an 'abort' event at once.
Shutdown (`drain`) asks every replica to drain its engine, so each request in flight ends within the grace
with its last event or a 'shutdown' error event from its replica, as with `python -m server`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import torch

from model.checkpoint import load_config, load_tokenizer
from model.config import PromptError
from model.generate import check_prompt
from model.sampling import SamplingParams
from server.api.engine_client import NotInProcessError
from server.cluster.feeds import Feeds, Followed, cancel_call, replica_gone, wire_id
from server.cluster.protocol import FeedEnded, Submission, Taken
from server.cluster.router import ReplicaReport, Router
from server.engine import FINISH_ABORT, FINISH_ERROR, EngineArgs, EngineInfo, EngineStoppedError, TokenOutput
from server.engine.counters import EngineCounters
from server.engine.engine import SHUTDOWN_MESSAGE
from server.engine.kv_view import KVSnapshot
from server.engine.step_stats import StepStatsSnapshot, merged

log = logging.getLogger("kvserve.cluster")

RETRIES = 2  # times a call that failed before its first event is sent again
RETRY_BACKOFF_S = 0.5  # seconds before the first retry, doubled each time
DRAIN_MARGIN_S = 2.0  # past the grace, for the replicas' last events to arrive before the ingress ends the rest


class RayEngineClient:
    def __init__(
        self,
        handle,
        engine_args: EngineArgs,
        router: Callable[[], Router | None],
        loop: asyncio.AbstractEventLoop,
        feeds: bool = True,
    ) -> None:
        """`handle`: the replicas' DeploymentHandle; `engine_args`: what each replica runs; `router`: this
        process's router once Ray Serve made it; `loop`: the ingress's event loop, where the handle is used
        (Ray Serve may run the handle's router on it, and then refuses calls from other threads); `feeds`:
        False to have every request's events ride its own call."""
        self.replicas = handle
        self.handle = handle.options(stream=True, method_name="generate")
        self.ingress_id = f"ingress-{uuid.uuid4().hex}" if feeds else None  # None: the replicas open no feed
        self.feeds = Feeds(handle, self.ingress_id, self._replica_gone)
        self.loop = loop
        self.engine_args = engine_args
        self.tokenizer = load_tokenizer(engine_args.checkpoint)
        model_config, limit = load_config(engine_args.checkpoint), engine_args.config.max_model_len
        # the model as the replicas serve it (server.cli.cluster_settings_from fixes a capped context for all)
        self.model_config = model_config if limit is None else model_config.with_context_length(limit)
        self.config = engine_args.config
        self._router = router
        self._calls: dict[str, asyncio.Task] = {}  # request id -> the call carrying it (copies share one)
        self._following: dict[asyncio.Task, Followed] = {}  # each call in flight -> its requests
        # request id -> done once a replica took it; its exception, if refused
        self._admissions: dict[str, asyncio.Future] = {}
        self._stopping = False  # draining: new requests are refused
        self.drained = threading.Event()  # set once `drain` has ended every request and closed the feeds

    @property
    def context_length(self) -> int:
        return self.model_config.context_length

    @property
    def info(self) -> EngineInfo:
        """One replica's figures (from its reports; the config's until the first arrives)."""
        reports = self.reports()
        num_blocks = reports[0].num_blocks if reports else (self.config.num_blocks or 0)
        kernels = reports[0].kernels if reports else self.config.kernels
        return EngineInfo(
            self.engine_args.dtype,
            self.engine_args.device.split(":")[0],
            kernels,
            num_blocks,
            self.config.block_size,
            self.config,
            in_process=False,
        )

    # ---- what the api layer calls -----------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Callable[[TokenOutput], None],
        *,
        use_cache: bool = True,
        request_id: str | None = None,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> str:
        self._check_admitting()
        check_prompt(prompt_ids, params.max_new_tokens, self.context_length, self.model_config.vocab_size)
        rid = request_id or f"cl-{uuid.uuid4().hex}"
        self._start(Submission([rid], list(prompt_ids), [params], use_cache, cache_salt, speculative), [sink])
        return rid

    def submit_copies(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        sinks: list,
        *,
        use_cache: bool = True,
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> list[str]:
        self._check_admitting()
        for p in params:
            check_prompt(prompt_ids, p.max_new_tokens, self.context_length, self.model_config.vocab_size)
        base = uuid.uuid4().hex
        ids = [f"cl-{base}-{k}" for k in range(len(params))]
        self._start(Submission(ids, list(prompt_ids), list(params), use_cache, cache_salt, speculative), sinks)
        return ids

    async def admitted(self, request_ids: list[str]) -> None:
        """Once a replica has taken each of these requests; raises the refusal (QueueFullError,
        EngineStoppedError) of one it did not take."""
        for future in {id(f): f for f in (self._admissions.get(rid) for rid in request_ids) if f}.values():
            await asyncio.shield(future)

    def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()

    # ---- what only an engine's own process answers ---------------------------------------------------

    async def kv_snapshot(self) -> KVSnapshot:
        raise NotInProcessError("the block pools are in the replicas' processes, not the ingress's")

    async def attention_rows(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        raise NotInProcessError("the model is in the replicas' processes, not the ingress's")

    # ---- the replicas' state, summed (the engine's gauges in /metrics) ------------------------------

    def reports(self) -> list[ReplicaReport]:
        router = self._router()
        if router is None:
            return []
        return [s.last_report for s in router.replicas.values() if s.last_report is not None]

    @property
    def num_running(self) -> int:
        return sum(r.running for r in self.reports())

    @property
    def num_waiting(self) -> int:
        return sum(r.waiting for r in self.reports())

    @property
    def kv_cache_usage(self) -> float:
        """Blocks held over blocks, all replicas together."""
        reports = self.reports()
        total = sum(r.num_blocks for r in reports)
        return sum(r.kv_cache_usage * r.num_blocks for r in reports) / total if total else 0.0

    def counters(self) -> EngineCounters:
        """The engine's running totals for /metrics, summed over the replicas' last reports."""
        return EngineCounters.summed([r.counters for r in self.reports()])

    def step_stats_snapshot(self) -> StepStatsSnapshot:
        """The replicas' engine steps, summed over their last reports."""
        target_ms = self.config.target_step_ms
        return merged(
            [r.step_stats for r in self.reports() if r.step_stats is not None],
            None if target_ms is None else target_ms / 1000,
            self.config.max_num_batched_tokens,
        )

    # ---- life cycle (the app's) ---------------------------------------------------------------------

    def start(self) -> RayEngineClient:
        return self

    def warmup(self) -> None:
        """One short request through the handle, sent on the ingress's loop from the loading thread: the
        request router is created and the path is warm."""
        params = SamplingParams(max_new_tokens=2, temperature=0)
        sub = Submission(
            [f"warmup-{uuid.uuid4().hex}"], (self.tokenizer.encode("Hello") or [0])[:8], [params], True, "warmup"
        )

        async def call() -> None:
            async for _ in self.handle.remote(sub):
                pass

        asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    @property
    def in_flight(self) -> int:
        """Calls to the replicas not ended."""
        return len(self._calls)

    def _replica_gone(self, replica_id: str) -> None:
        """A call or feed to `replica_id` failed because it died or cannot be reached: the router stops
        counting it (/health's replicas_ready) and choosing it now, not once Serve's controller notices (and
        takes it back if it reports again: `Router.report`)."""
        router = self._router()
        if router is not None:
            router.replica_lost(replica_id)

    def _check_admitting(self) -> None:
        if self._stopping:  # as the local engine refuses once it drains (a 503)
            raise EngineStoppedError("the server is shutting down and takes no new requests")

    def drain(self, grace: float) -> None:
        """No new requests; every replica's engine gives those in flight `grace` seconds, then ends them with
        a 'shutdown' error event that reaches their streams as any event does. Those still open
        DRAIN_MARGIN_S later (their replica did not answer) end here the same way. Then the feeds close, so
        that Serve finds the replicas idle when it stops them. Blocks until then."""
        self._stopping = True
        deadline = time.monotonic() + grace + DRAIN_MARGIN_S
        try:
            asyncio.run_coroutine_threadsafe(self._drain_replicas(grace), self.loop)
            while self._calls and time.monotonic() < deadline:
                time.sleep(0.05)
            asyncio.run_coroutine_threadsafe(self._end_all_for_shutdown(), self.loop).result(timeout=10)
        finally:
            self.drained.set()

    async def _drain_replicas(self, grace: float) -> None:
        try:
            results = await self.replicas.broadcast("drain", grace).results_async(
                timeout_s=grace + DRAIN_MARGIN_S, return_exceptions=True
            )
        except Exception as e:  # noqa: BLE001 - the requests still open end at the ingress
            log.warning("could not ask the replicas to drain: %s", _message(e))
            return
        for failed in (r for r in results if isinstance(r, Exception)):
            log.warning("a replica did not drain: %s", _message(failed))

    async def _end_all_for_shutdown(self) -> None:
        """Every request still open ends with a 'shutdown' error event and its call is cancelled (the
        replica aborts what is left of it); no feed stays open."""
        for call, followed in list(self._following.items()):
            followed.end(FINISH_ERROR, SHUTDOWN_MESSAGE, "shutdown")
            call.cancel()
        self.feeds.close()

    def shutdown(self, timeout: float = 30.0) -> None:
        asyncio.run_coroutine_threadsafe(self._end_all_for_shutdown(), self.loop)

    # ---- one call -----------------------------------------------------------------------------------

    def _start(self, sub: Submission, sinks: list) -> None:
        loop = asyncio.get_running_loop()
        admission = loop.create_future()
        followed = Followed(dict(zip(sub.request_ids, sinks)), set(sub.request_ids), loop.create_future())
        call = loop.create_task(self._relay(sub, followed, admission))
        # whatever way the call ends, even cancelled before its first line ran (an abort right after submit)
        call.add_done_callback(lambda task: self._ended(task, sub, followed, admission))
        self._following[call] = followed
        for rid in sub.request_ids:
            self._calls[rid] = call
            self._admissions[rid] = admission

    def _ended(self, call: asyncio.Task, sub: Submission, followed: Followed, admission: asyncio.Future) -> None:
        """Every request of the call has its last event, its admission an answer, and the call is forgotten."""
        self._following.pop(call, None)
        self.feeds.unfollow(followed)
        if call.cancelled():  # a call cancelled before it ran, or a stream that stopped short
            followed.end(FINISH_ABORT)
        else:
            followed.end(FINISH_ERROR, "the replica's stream ended before the request did", "generation")
        if not admission.done():  # ended otherwise: its events say how
            admission.set_result(None)
        router = self._router()
        if router is not None:  # a call no replica took (cancelled in Serve's queue) counts on none
            for attempt in range(followed.attempt + 1):
                router.release(wire_id(sub.request_ids[0], attempt))  # each attempt's call, by its first id
        for rid in sub.request_ids:
            if self._calls.get(rid) is call:
                del self._calls[rid]
                self._admissions.pop(rid, None)

    async def _relay(self, sub: Submission, followed: Followed, admission: asyncio.Future) -> None:
        response = None
        try:
            for attempt in range(RETRIES + 1):
                try:
                    self.feeds.expect(followed)
                    response = self.handle.remote(
                        replace(
                            sub,
                            request_ids=list(followed.wire_ids),
                            ingress_id=self.ingress_id,
                            dead_feeds=self.feeds.dead_feeds(),
                        )
                    )
                    if await self._read_call(response, followed, admission):
                        await self._on_feed(response, followed)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - every failure reaches the client as an event
                    if response is not None:  # an attempt given up may still run on a replica that lives
                        cancel_call(response)
                    if followed.replica is not None and replica_gone(e):
                        self._replica_gone(followed.replica)
                    self.feeds.unfollow(followed)
                    if not followed.open_ids:  # ended already (its events said how)
                        return
                    if not followed.started and attempt < RETRIES and _worth_again(e):
                        log.warning(
                            "request %s lost its replica or feed before it started (%s); retrying",
                            sub.request_ids[0],
                            _message(e),
                        )
                        router = self._router()
                        if router is not None:  # the next attempt is a call of its own, routed again
                            router.release(wire_id(sub.request_ids[0], attempt))
                        followed.again()
                        await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
                        continue
                    refusal = _refusal(e)
                    if refusal is not None and not admission.done():  # an HTTP status, not an error event
                        admission.set_exception(refusal)
                        followed.open_ids.clear()
                        return
                    log.warning("request %s failed on its replica: %s", sub.request_ids[0], _message(e))
                    followed.end(FINISH_ERROR, _message(e), _error_type(e))
                    return
        except asyncio.CancelledError:
            if response is not None:  # the replica's generator too, whichever transport Serve uses
                cancel_call(response)
            raise

    async def _read_call(self, response, followed: Followed, admission: asyncio.Future) -> bool:
        """The call's items until its `Taken` names a feed (True: the rest comes there) or its stream ends
        (False: it carried every event)."""
        async for item in response:
            if not admission.done():
                admission.set_result(None)
            if isinstance(item, Taken):  # the replica that took it, and where its events come
                self.feeds.taken(followed, item)
                if followed.feed_id is not None:
                    return True
            else:  # a batch of its events, on its own stream
                for out in item:
                    followed.deliver(out)
        return False

    @staticmethod
    async def _on_feed(response, followed: Followed) -> None:
        """Until every request of the call has its last event from the feed, whichever of the call's end and
        the feed's comes first. Raises FeedLost if the feed ended before any of their events came, and the
        call's own failure if the call failed first."""
        ended = asyncio.ensure_future(_until_the_end(response))
        ended.add_done_callback(lambda task: task.cancelled() or task.exception())  # read here, or not needed
        try:
            await asyncio.wait({ended, followed.closed}, return_when=asyncio.FIRST_COMPLETED)
            if not followed.closed.done():  # the call ended first: it raises its failure, if it failed
                ended.result()
                await followed.closed  # it ended as its requests did: their last events are on the way
            if followed.lost is not None:
                raise FeedLost(*followed.lost)
        finally:
            if followed.open_ids or followed.lost or followed.cut or not followed.closed.done():
                ended.cancel()  # given up (failed, lost, cut, cancelled): the replica aborts what is left
                cancel_call(response)
            # else done: the call ends on its own right after its last event was queued on the feed


class FeedLost(Exception):
    """The feed a call's requests rode ended before any of their events came: the call is sent again."""

    def __init__(self, why: str, error_type: str) -> None:
        super().__init__(why)
        self.error_type = error_type


async def _until_the_end(response) -> None:
    async for _ in response:
        pass


def _worth_again(e: BaseException) -> bool:
    """A failure that a new attempt of a call that produced nothing yet may not meet: its replica died, or
    the feed its events rode ended."""
    return replica_gone(e) or isinstance(e, FeedLost) or isinstance(_cause(e), FeedEnded)


def _cause(e: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper, when it crossed."""
    return getattr(e, "cause", None) or e


def _message(e: BaseException) -> str:
    if replica_gone(e):
        return "the replica serving this request died"
    cause = _cause(e)
    return f"{type(cause).__name__}: {cause}"


def _refusal(e: BaseException) -> Exception | None:
    """The refusal a failed call stands for, as the local engine's submit raises it: None for another failure."""
    from ray.serve.exceptions import BackPressureError

    from server.engine import EngineStoppedError, QueueFullError

    cause = _cause(e)
    if isinstance(cause, (PromptError, QueueFullError, EngineStoppedError)):  # PromptError: its KV cache's size
        return cause
    if isinstance(e, BackPressureError) or isinstance(cause, BackPressureError):
        return QueueFullError(f"every replica is at its limit of requests and Serve's queue is full ({cause})")
    return None


def _error_type(e: BaseException) -> str:
    """A failure's error_type, where it is no refusal answered as one (a retry refused after the request's
    first attempt was taken): Serve's full queue is as overloaded as the engine's (a 429, not a 500)."""
    from server.engine import EngineStoppedError, QueueFullError

    if isinstance(e, FeedLost):
        return e.error_type
    refusal = _refusal(e)
    if isinstance(refusal, EngineStoppedError):
        return "shutdown"
    if isinstance(refusal, QueueFullError):
        return "overloaded"
    return "generation"
