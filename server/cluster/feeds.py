"""The ingress's end of the replicas' feeds: one stream from each replica carries the events of this
ingress's requests there, an engine step's worth an item (`EngineReplica.feed`), where a stream per
request would carry one item per request and step.

Each request's own call (client.py) still takes it to its replica, holds its place in Ray Serve's
queues and counts, and is how it is cancelled. The call's first item (`Taken`) names the one stream its
events ride: a feed, by the id this ingress gave it, or the call itself. The two streams keep no order
between them, so events that come on a feed before the call's `Taken` are held for the request until
it arrives. A request on a feed ends when its last event comes there; if the feed ends first, for any
reason, the request ends with an error (the replica aborts it too), never a hang. Each attempt of a
call has request ids of its own on the wire (`Followed.wire_ids`), so an event of an attempt given up
(a retry after a replica fault) is never taken for the next one's.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from server.cluster.protocol import FeedRequest, Taken
from server.engine import FINISH_ERROR, AsyncSink, TokenOutput

log = logging.getLogger("kvserve.cluster")

FEED_ATTACH_TIMEOUT_S = 10.0  # a feed not attached by then (its replica gone, or full) is given up
FEED_RETRY_S = 1.0  # after a feed failed, its replica's next one is asked for no sooner than this
ENDED_FEEDS_KEPT = 256  # ended feeds remembered, for a `Taken` naming one that arrives late
DEAD_FEEDS_KEPT = 16  # broken feeds named in every call, so that a replica still holding one closes it
DEAD_FEED_NAMED_S = 60.0  # for this long after it broke
FEED_ENDED = "the replica's stream of events ended before the request did"


@dataclass(eq=False)
class Followed:
    """One call's requests, as the ingress follows them: their sinks, and where their events come from."""

    sinks: dict  # request id -> its sink (a callable or an AsyncSink)
    open_ids: set[str]  # the requests without their last event yet
    closed: asyncio.Future  # done once open_ids is empty, or once `lost`
    attempt: int = 0  # the call's attempt: 0, then one more for each retry
    feed_id: str | None = None  # the feed its events ride, once its `Taken` said so
    replica: str | None = None  # the replica that took this attempt, once its `Taken` said so
    early: list[tuple[str, TokenOutput]] = field(default_factory=list)  # (feed id, event) before its `Taken`
    started: bool = False  # an event has reached a sink
    lost: tuple[str, str] | None = None  # (why, error type): its feed ended before any of its events came
    cut: bool = False  # its feed ended after some of its events came: its requests ended with an error

    @property
    def wire_ids(self) -> dict[str, str]:
        """This attempt's request id on the wire -> the request's own id."""
        return {wire_id(rid, self.attempt): rid for rid in self.sinks}

    def deliver(self, out: TokenOutput) -> None:
        """`out` carries this attempt's id on the wire (`end` makes one so)."""
        rid = unwired(out.request_id, self.attempt)
        if rid not in self.open_ids:
            return
        if rid != out.request_id:
            out = dataclasses.replace(out, request_id=rid)
        self.started = self.started or out.token_id is not None or out.finished
        deliver(self.sinks[rid], out)
        if out.finished:
            self.open_ids.discard(rid)
            if not self.open_ids and not self.closed.done():
                self.closed.set_result(None)

    def end(self, reason: str, error: str | None = None, error_type: str | None = None) -> None:
        """Every open request ends here with `reason`."""
        for rid in list(self.open_ids):
            self.deliver(end_event(wire_id(rid, self.attempt), reason, error, error_type))

    def lose(self, why: str, error_type: str) -> None:
        """Its feed ended first: with none of its events delivered, its call is sent again (`lost`); else
        its requests end with an error (`cut`)."""
        if self.started:
            self.cut = bool(self.open_ids)  # none open: they all had their last event, nothing to cut
            self.end(FINISH_ERROR, why, error_type)
            return
        self.lost = (why, error_type)
        if not self.closed.done():
            self.closed.set_result(None)

    def again(self) -> None:
        """For the call's next attempt."""
        self.attempt, self.lost = self.attempt + 1, None
        if self.closed.done() and self.open_ids:
            self.closed = asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class FeedState:
    """One feed as the ingress reads it."""

    feed_id: str
    replica: str
    followers: set[Followed] = field(default_factory=set)  # calls whose requests ride it and are open


class Feeds:
    def __init__(self, handle, ingress_id: str, on_replica_gone: Callable[[str], None] = lambda replica: None) -> None:
        """`on_replica_gone(replica)`: an attached feed failed because its replica died or cannot be reached."""
        self.handle = handle.options(stream=True, method_name="feed")
        self.ingress_id = ingress_id
        self.on_replica_gone = on_replica_gone
        self._by_replica: dict[str, FeedState] = {}  # replica -> its feed, while open
        self._by_id: dict[str, FeedState] = {}  # the open feeds
        self._ended: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()  # -> (why, type)
        self._dead: collections.OrderedDict[str, float] = collections.OrderedDict()  # broken feed -> when
        self._by_wire: dict[str, Followed] = {}  # request id on the wire -> its call's requests
        self._readers: set[asyncio.Task] = set()
        self._not_before: dict[str, float] = {}  # replica -> when its feed may be asked for again
        self._closing = False
        self.requests_by_stream: collections.Counter[str] = collections.Counter()  # "feed" or "call" -> calls taken
        self.feeds_failed = 0  # feeds that broke or were never attached

    def expect(self, followed: Followed) -> None:
        """Before its call's attempt is sent: its events may come on a feed before the call's `Taken`."""
        followed.feed_id, followed.replica, followed.early = None, None, []
        for wire in followed.wire_ids:
            self._by_wire[wire] = followed

    def dead_feeds(self) -> tuple[str, ...]:
        """The feeds that broke here lately, for each call to name (a replica still holding one closes it)."""
        now = asyncio.get_running_loop().time()
        while self._dead and next(iter(self._dead.values())) < now - DEAD_FEED_NAMED_S:
            self._dead.popitem(last=False)
        return tuple(self._dead)

    def taken(self, followed: Followed, taken: Taken) -> None:
        """A replica took `followed`'s call: its events ride the feed `taken` names, or the call itself.
        Either way that replica's feed is opened for the requests to come, if it is not. If that feed has
        ended already, the call is `lost` (or its requests end with an error, if some of its events came)."""
        self.open(taken.replica_id)
        followed.replica = taken.replica_id
        early, followed.early = followed.early, []
        self.requests_by_stream["call" if taken.feed_id is None else "feed"] += 1
        if taken.feed_id is None:
            self.unfollow(followed)
            return
        followed.feed_id = taken.feed_id
        for feed_id, out in early:
            if feed_id == taken.feed_id:
                followed.deliver(out)
        state = self._by_id.get(taken.feed_id)
        if state is None:  # it ended before this `Taken` came
            self.unfollow(followed)
            followed.lose(*self._ended.get(taken.feed_id, (FEED_ENDED, "generation")))
        elif followed.open_ids:
            state.followers.add(followed)
        else:
            self.unfollow(followed)

    def unfollow(self, followed: Followed) -> None:
        """This attempt's events, if any still come on a feed, go nowhere."""
        for wire in followed.wire_ids:
            if self._by_wire.get(wire) is followed:
                del self._by_wire[wire]
        state = self._by_id.get(followed.feed_id) if followed.feed_id is not None else None
        if state is not None:  # FeedState and Followed hash by identity
            state.followers.discard(followed)

    def open(self, replica: str) -> None:
        loop = asyncio.get_running_loop()
        if self._closing or replica in self._by_replica or loop.time() < self._not_before.get(replica, 0.0):
            return
        self._not_before.pop(replica, None)
        state = FeedState(f"feed-{uuid.uuid4().hex}", replica)
        self._by_replica[replica] = self._by_id[state.feed_id] = state
        # in a context of its own, not the request's whose `Taken` opened it: Serve counts a handle call made in
        # a request's context as that request's child and cancels it with the request (its client left)
        reader = contextvars.Context().run(loop.create_task, self._read(state))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    def close(self) -> None:
        self._closing = True
        for reader in list(self._readers):
            reader.cancel()

    async def _read(self, state: FeedState) -> None:
        why, error_type, attached = FEED_ENDED, "generation", False
        call = self.handle.remote(FeedRequest(self.ingress_id, state.replica, state.feed_id))
        try:
            await asyncio.wait_for(call.__anext__(), FEED_ATTACH_TIMEOUT_S)  # [] once attached there
            attached = True
            async for batch in call:
                for out in batch:
                    followed = self._by_wire.get(out.request_id)
                    if followed is None:  # ended here already, or an attempt given up
                        continue
                    if followed.feed_id == state.feed_id:
                        followed.deliver(out)
                        if not followed.open_ids:
                            self.unfollow(followed)
                    elif followed.feed_id is None:  # its `Taken` is still on the way
                        followed.early.append((state.feed_id, out))
        except asyncio.CancelledError:
            cancel_call(call)
            why, error_type = "the ingress is shutting down", "shutdown"
            raise
        except Exception as e:  # noqa: BLE001 - its requests end with the reason
            cancel_call(call)
            if attached and replica_gone(e):
                self.on_replica_gone(state.replica)
            why = f"the replica's stream of events failed: {type(e).__name__}: {e}"
            # not attached: its replica full (requests took the feed's place), refused, or gone; requests
            # there ride their own calls meanwhile
            log.log(logging.WARNING if attached else logging.INFO, "feed from replica %s ended: %s", state.replica, why)
            self.feeds_failed += 1
            now = asyncio.get_running_loop().time()
            self._not_before = {r: t for r, t in self._not_before.items() if t > now}  # the replicas still held off
            self._not_before[state.replica] = now + FEED_RETRY_S
            self._dead[state.feed_id] = now
            while len(self._dead) > DEAD_FEEDS_KEPT:
                self._dead.popitem(last=False)
        finally:
            self._ended_now(state, why, error_type)

    def _ended_now(self, state: FeedState, why: str, error_type: str) -> None:
        if self._by_replica.get(state.replica) is state:
            del self._by_replica[state.replica]
        del self._by_id[state.feed_id]
        self._ended[state.feed_id] = (why, error_type)
        if len(self._ended) > ENDED_FEEDS_KEPT:
            self._ended.popitem(last=False)
        for followed in list(state.followers):
            self.unfollow(followed)
            followed.lose(why, error_type)


def replica_gone(e: BaseException) -> bool:
    """A call failed because the replica it reached died, or cannot be reached (Ray's word for a replica
    whose process was killed, until Serve's controller declares it dead)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


def cancel_call(response) -> None:
    """Cancels a handle call: its assignment, or the replica's stream it was assigned to, also when the
    assignment has finished but the call has not yet read it (then `cancel` alone reaches neither)."""
    try:  # Serve's `cancel` re-raises a failed assignment's error (its queue full): nothing to cancel then
        response.cancel()
    except Exception:  # noqa: BLE001
        return
    assigned = getattr(response, "_replica_result_future", None)  # Serve 2.60's; absent elsewhere
    if assigned is not None and assigned.done() and not assigned.cancelled() and assigned.exception() is None:
        assigned.result().cancel()


def wire_id(request_id: str, attempt: int) -> str:
    """A request's id on the wire in its call's `attempt` (0 for the first: its own)."""
    return f"{request_id}~{attempt}" if attempt else request_id


def unwired(wire: str, attempt: int) -> str:
    """The request's own id, from its id on the wire in `attempt`."""
    return wire.rpartition("~")[0] if attempt else wire


def deliver(sink, out: TokenOutput) -> None:
    if isinstance(sink, AsyncSink):  # on its loop already
        sink.events.put_nowait(out)
    else:
        sink(out)


def end_event(request_id: str, reason: str, error: str | None = None, error_type: str | None = None) -> TokenOutput:
    return TokenOutput(request_id, 0, None, "", 0.0, False, reason, error=error, error_type=error_type)
