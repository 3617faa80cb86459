"""Our router inside Ray Serve's request-router extension point (`RequestRouter`, Ray 2.60).

Ray Serve creates one of these in every process that holds a handle to the replicas (here, each
ingress replica) and asks it, per request, for replicas in order of preference. It reads the prompt
from the request's `Submission`, the replicas' reports from their `routing_stats` (which Serve polls
from `EngineReplica.record_routing_stats` every `request_routing_stats_period_s`), and lets
`server.cluster.router.Router` decide. Ray does the rest: it sends to the replica of the first rank
with room (`max_ongoing_requests`; within a rank, the shortest queue by its probes), falls back to the
next ranks, and retries a request that never started on a replica that died. An ingress's feed
(`FeedRequest`, feeds.py) goes to the replica it names (while that one is gone, to any, which refuses it:
a routing that no replica could ever take would hold one of Serve's routing tasks for good). `pow2` hands
Serve two replicas drawn at random as one rank, so that Serve's probes and queue-length cache pick the
shorter queue, the core of Ray Serve's `PowerOfTwoChoicesRequestRouter` (without its locality ranks),
through the class that can send the feeds.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

import server.cluster.router as router_core
from server.cluster.protocol import FeedRequest, Submission
from server.cluster.router import DEFAULT_IMBALANCE_THRESHOLD, ReplicaReport, Router


class KVCacheRequestRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = "kv",
        block_size: int = 16,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        **kwargs: Any,
    ) -> None:
        self.router = Router(policy, block_size, imbalance_threshold=imbalance_threshold)
        # Serve pickles this module by value: the registry is reached through the router module, the one
        # copy the ingress reads
        router_core.ROUTERS[self._deployment_id.name] = self.router
        self._seen_reports: dict[str, float] = {}  # replica -> time of the last report applied

    def _sync(self, candidates: list[RunningReplica]) -> None:
        ids = [r.replica_id.unique_id for r in candidates]
        if set(ids) != set(self.router.replicas):
            self.router.set_replicas(ids)
            self._seen_reports = {rid: t for rid, t in self._seen_reports.items() if rid in ids}
        for r in candidates:
            report = ReplicaReport.from_stats(r.routing_stats)
            rid = r.replica_id.unique_id
            if report is not None and self._seen_reports.get(rid) != report.time:
                self._seen_reports[rid] = report.time
                self.router.report(report)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new view of the replicas (membership, or a replica's routing_stats changed)."""
        super().update_replicas(replicas)
        self._sync(replicas)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._sync(candidate_replicas)
        live = [r for r in candidate_replicas if r.replica_id.unique_id in self.router.replicas]
        if not live:  # only replicas a failure showed dead, which Serve still lists: Serve's own choice
            return [candidate_replicas]
        candidate_replicas = live
        if pending_request is not None:  # when no replica takes it, Serve waits before asking again
            pending_request.routing_context.should_backoff = True
        feed = _arg(pending_request, FeedRequest)
        if feed is not None:  # an ingress's feed: its replica; any while that one is gone, which refuses it
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == feed.replica_id]
            return [chosen or candidate_replicas]
        sub = _arg(pending_request, Submission)
        if sub is None:  # not a generation (status calls): any replica
            return [candidate_replicas]
        if self.router.policy == "pow2":  # Ray Serve's power of two choices: Serve takes the shorter queue
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        call_id = sub.request_ids[0]  # ours, one per call (`RayEngineClient` releases it when the call ends)
        decision = self.router.unsent.get(call_id)
        if decision is None or decision.replica_id not in self.router.replicas:
            if decision is not None:  # its replica is gone
                self.router.unrouted(decision)
            decision = self.router.decide(sub.prompt_ids, cache_salt=sub.cache_salt, use_cache=sub.use_cache)
            # counted at once, so the requests routed before any replica took one see it; undone if the
            # call ends before a replica takes it (cancelled in Serve's queue)
            self.router.routed(decision, decision.replica_id)
            self.router.hold(call_id, decision)
        first = [r for r in candidate_replicas if r.replica_id.unique_id == decision.replica_id]
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != decision.replica_id),
            key=lambda r: self.router.replicas[r.replica_id.unique_id].load,
        )
        return [first, rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """A replica took the request (Serve calls this for its Python handles, whose replicas refuse a
        request past `max_ongoing_requests`): it is in flight there until its result is done, moved there if
        Serve sent it elsewhere than the replica chosen (a 'redirect' in the router's decisions). Counted
        down by the result itself, which may be done already: Serve's own completion report can arrive
        before this call."""
        sub = _arg(pending_request, Submission)
        decision = self.router.taken(sub.request_ids[0]) if sub is not None else None
        if decision is None:
            return
        actual = replica_id.unique_id
        if actual != decision.replica_id:
            self.router.unrouted(decision)
            self.router.routed(decision, actual)
        self.router.arrived(decision, actual)  # a rebalanced prefix leaves its old replica, if it went where chosen
        # called from one of Ray's threads (or at once, if done); `finished` takes the router's lock
        result.add_done_callback(lambda _: self.router.finished(actual))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Serve saw a call to `replica_id` fail because its actor died: gone for good (before its controller
        notices), as when the ingress sees it (`RayEngineClient`)."""
        super().on_replica_actor_died(replica_id)
        self.router.replica_lost(replica_id.unique_id)


def _arg(pending: PendingRequest | None, cls: type):
    """The request's argument of type `cls`, if it has one."""
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, cls):
            return arg
    return None
