"""The ingress's end of the replicas' feeds: one stream from each replica carries the events of every
request this ingress sent there, an engine step's worth an item (`EngineReplica.feed`), where a stream
per request would carry one item per request and step. A request's own call (`generate`) still takes
it to its replica, holds its place in Ray Serve's queues and counts, and is how it is cancelled; it ends
once the request has its last event on the feed.

A request is expected on every feed from before its call is sent (its events may come before the call
says which replica took it); a feed opens when a call says so, and ends when that replica has had no
request of ours open for a while (it opens again at the next). A feed that fails (its replica died)
ends the requests on it that have had events with an error event; one that has had none is left to its
own call, which fails too and is sent again (client.py).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from server.cluster.protocol import FeedRequest, Taken
from server.engine import FINISH_ERROR, AsyncSink, TokenOutput

log = logging.getLogger("kvserve.cluster")

FEED_OPEN_TIMEOUT_S = 10.0  # a feed not attached by then (its replica gone, or leaving) is given up
FEED_RETRY_S = 1.0  # after a feed failed, its replica's next one is asked for no sooner than this


@dataclass(eq=False)
class Followed:
    """One call's requests, as the ingress follows them: their sinks and which have not ended."""

    sinks: dict  # request id -> its sink (a callable or an AsyncSink)
    open_ids: set[str]  # the requests without their last event yet
    closed: asyncio.Future  # done once open_ids is empty
    replica: str | None = None  # the replica whose feed carries them
    started: bool = False  # an event has reached a sink
    lost: str | None = None  # why the feed ended before they did (they had no event yet)
    stale: set[str] = field(default_factory=set)  # replicas of earlier attempts: their events are dropped

    def deliver(self, out: TokenOutput) -> None:
        if out.request_id not in self.open_ids:
            return
        self.started = self.started or out.token_id is not None or out.finished
        deliver(self.sinks[out.request_id], out)
        if out.finished:
            self.open_ids.discard(out.request_id)
            if not self.open_ids and not self.closed.done():
                self.closed.set_result(None)

    def end(self, reason: str, error: str | None = None, error_type: str | None = None) -> None:
        """Every open request ends here with `reason`."""
        for rid in list(self.open_ids):
            self.deliver(end_event(rid, reason, error, error_type))


class Feeds:
    def __init__(self, handle, ingress_id: str) -> None:
        self.handle = handle.options(stream=True, method_name="feed")
        self.ingress_id = ingress_id
        self._readers: dict[str, asyncio.Task] = {}  # replica -> the task reading its feed
        self._by_request: dict[str, Followed] = {}
        self._not_before: dict[str, float] = {}  # replica -> when its feed may be asked for again

    def expect(self, followed: Followed) -> None:
        """Before its call is sent: its events may come on a feed before the call says which replica took
        it (the two streams keep no order between them)."""
        for rid in followed.open_ids:
            self._by_request[rid] = followed

    def taken(self, followed: Followed, taken: Taken) -> None:
        """A replica took `followed`'s call: its events come on that replica's feed, or on the call
        itself; either way the feed is opened for the requests to come."""
        if taken.on_feed:
            followed.replica = taken.replica_id
        else:
            self.unfollow(followed)
        self.open(taken.replica_id)

    def unfollow(self, followed: Followed, stale: bool = False) -> None:
        """Its events, if any still come, go nowhere; `stale`: nor will its replica's, if it is sent again."""
        for rid in followed.sinks:
            if self._by_request.get(rid) is followed:
                del self._by_request[rid]
        if stale and followed.replica is not None:
            followed.stale.add(followed.replica)
        followed.replica = None

    def open(self, replica: str) -> None:
        loop = asyncio.get_running_loop()
        if replica not in self._readers and loop.time() >= self._not_before.get(replica, 0.0):
            self._readers[replica] = loop.create_task(self._read(replica))

    def close(self) -> None:
        for reader in self._readers.values():
            reader.cancel()

    async def _read(self, replica: str) -> None:
        why = None
        call = self.handle.remote(FeedRequest(self.ingress_id, replica))
        try:
            await asyncio.wait_for(call.__anext__(), FEED_OPEN_TIMEOUT_S)  # [] once attached there
            async for batch in call:
                for out in batch:
                    followed = self._by_request.get(out.request_id)
                    if followed is None or replica in followed.stale:
                        continue
                    followed.replica = followed.replica or replica  # ahead of its call's own word
                    followed.deliver(out)
                    if out.finished:
                        del self._by_request[out.request_id]
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - its requests end with the reason
            call.cancel()
            why = f"the replica's stream of events failed: {type(e).__name__}: {e}"
            self._not_before[replica] = asyncio.get_running_loop().time() + FEED_RETRY_S
        finally:
            if self._readers.get(replica) is asyncio.current_task():
                del self._readers[replica]
        on_it = {id(f): f for f in self._by_request.values() if f.replica == replica}.values()
        if why is None:
            if on_it:  # it ended as a request was taken there: open it again (the replica kept the events)
                self.open(replica)
            return
        log.warning("feed of replica %s ended: %s", replica, why)
        for followed in list(on_it):
            if followed.started:
                self.unfollow(followed)
                followed.end(FINISH_ERROR, why, "generation")
            else:  # its own call decides: sent again if it failed too, else ended with this error
                followed.lost = why
                if not followed.closed.done():
                    followed.closed.set_result(None)


def deliver(sink, out: TokenOutput) -> None:
    if isinstance(sink, AsyncSink):  # on its loop already
        sink.events.put_nowait(out)
    else:
        sink(out)


def end_event(request_id: str, reason: str, error: str | None = None, error_type: str | None = None) -> TokenOutput:
    return TokenOutput(request_id, 0, None, "", 0.0, False, reason, error=error, error_type=error_type)
