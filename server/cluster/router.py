"""Which replica serves a request: KV-cache-aware routing and its baselines, as plain Python (no Ray), so
the Ray Serve ingress and the routing simulator (`bench/routing_sim.py`) run the same code.

- Each replica reports a `ReplicaReport`: the keys of the full blocks its prefix cache holds (a
  snapshot bounded by its block count) and its load (running, waiting, free blocks).
- The router computes a prompt's block keys with the block manager's own hash chain
  (`extend_block_keys`), and between reports remembers what it sent where: the keys of a request it
  routed count as held by that replica for `pending_ttl` seconds, until a report confirms them.
- `kv`: the replica holding the longest prefix of the prompt; among replicas that hold as much and whose
  loads are within half the threshold of the least loaded of them, the one this router sent that prefix
  to most often lately (its home: a copy a fallback left elsewhere is used once and evicted first, where
  sending the tenant's next requests there would keep two copies and crowd out that replica's own
  tenants), then the least loaded. When the chosen replica's load exceeds the least loaded one's by
  more than `imbalance_threshold` requests, the least loaded instead (a fallback). When the prefixes
  sent to the chosen replica again and again lately need more than `OVERFLOW_MARGIN` of its blocks (more
  tenants landed there than its cache holds, and they evict each other) and another replica has room
  for this one, the prefix moves there for good (a rebalance: one miss, where staying misses again and
  again).
  A prompt none holds starts a new prefix: it goes, among the replicas
  within the threshold of the least loaded, to the one with the smallest recent working set (the
  distinct block keys routed to it lately, expired with the pending ones; a replica's reported cache is
  always full once it has run a while, so it says nothing), then the least loaded: tenants spread
  over the caches by the room their prefixes take, as SGLang's cache-aware policy sends a request that
  matches little to the worker with the smallest prefix tree. `pow2`: the less loaded of two drawn at
  random. `round-robin`: in turn.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from server.engine.block_manager import BlockManager, extend_block_keys
from server.engine.counters import EngineCounters
from server.engine.step_stats import StepStatsSnapshot

POLICIES = ("kv", "pow2", "round-robin")
ROUTERS: dict[str, Router] = {}  # this process's routers by deployment name (Ray Serve makes them; /metrics reads)
DEFAULT_IMBALANCE_THRESHOLD = 8  # requests: past this gap in load, `kv` routes to the least loaded replica
DEFAULT_PENDING_TTL = 30.0  # seconds a routed request's keys count as held before a report confirms them
OVERFLOW_MARGIN = 0.9  # a replica whose reused prefixes take more of its blocks than this hands one over


@dataclass
class ReplicaReport:
    """What a replica tells the router: its prefix cache and its load, at one moment."""

    replica_id: str  # the replica's name (stable across the router's calls)
    held_keys: list[int]  # keys of the full blocks its prefix cache holds (at most its block count)
    running: int  # requests holding blocks
    waiting: int  # requests queued
    free_blocks: int  # blocks no request holds (some still caching a prefix)
    num_blocks: int  # its block pool's size
    time: float = field(default_factory=time.time)  # when it was taken
    counters: EngineCounters = field(default_factory=EngineCounters)  # its engine's totals since it started
    kv_cache_usage: float = 0.0  # fraction of blocks held (0..1)
    pid: int = 0  # its process
    kernels: str = ""  # the kernels its model runs (exact or stock)
    step_stats: StepStatsSnapshot | None = None  # its engine's steps, for the ingress's /metrics

    def to_stats(self) -> dict:
        """As Ray Serve's routing_stats: builtins only (the nested dataclasses as dicts), so Serve's
        controller, which relays them, needs none of our modules to unpickle them; by field name, so no
        reading depends on the order of the fields. `from_stats` reads them back."""
        return {"kvserve_report": dataclasses.asdict(self)}

    @classmethod
    def from_stats(cls, stats: dict | None) -> ReplicaReport | None:
        fields = (stats or {}).get("kvserve_report")
        if fields is None:
            return None
        steps = fields.get("step_stats")
        return cls(
            **{
                **fields,
                "counters": EngineCounters.from_dict(fields["counters"]),
                "step_stats": None if steps is None else StepStatsSnapshot.from_dict(steps),
            }
        )


@dataclass
class Decision:
    """Where one request goes, and why (the router's metrics count these)."""

    replica_id: str  # the chosen replica
    policy: str  # kv, pow2 or round-robin
    outcome: str  # 'hit' (a cached prefix won), 'miss' (none cached), 'fallback' (load won), 'rebalance' (the
    # prefix moves off a replica its reused prefixes overflow), 'baseline' (pow2, rr)
    matched_blocks: int  # leading blocks of the prompt the chosen replica is believed to hold
    prompt_blocks: int  # full blocks in the prompt
    keys: list[int] = field(repr=False, default_factory=list)  # the prompt's block keys
    moved_from: str | None = None  # rebalance: the replica the prefix leaves
    routed_at: float = 0.0  # when `routed` counted it on its replica (the router's clock)


class ReplicaState:
    """The router's picture of one replica."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.held: set[int] = set()  # keys of the last report
        self.pending: dict[int, float] = {}  # key -> when a request carrying it was routed here
        self.routed_keys: dict[int, float] = {}  # block key -> when a request carrying it was last routed here
        self.routed_counts: dict[int, int] = {}  # block key -> requests carrying it routed here (as routed_keys)
        self.shared_keys = 0  # keys of routed_counts routed here more than once: the prefixes it is kept busy with
        self.running = self.waiting = self.free_blocks = self.num_blocks = 0
        self.inflight = 0  # requests this router sent here that have not finished
        self.last_report: ReplicaReport | None = None

    @property
    def load(self) -> int:
        """Requests on the replica: what it reported, or what this router knows it sent, if more."""
        return max(self.running + self.waiting, self.inflight)

    def apply(self, report: ReplicaReport) -> None:
        self.held = set(report.held_keys)
        for key in self.held.intersection(self.pending):
            del self.pending[key]
        self.running, self.waiting = report.running, report.waiting
        self.free_blocks, self.num_blocks = report.free_blocks, report.num_blocks
        self.last_report = report

    def matched(self, keys: Sequence[int], now: float, ttl: float) -> int:
        """How many leading keys this replica is believed to hold."""
        n = 0
        for key in keys:
            if key in self.held:
                n += 1
                continue
            since = self.pending.get(key)
            if since is None or now - since > ttl:
                break
            n += 1
        return n

    def expect(self, keys: Sequence[int], now: float) -> None:
        for key in keys:
            if key not in self.held:
                self.pending[key] = now
            self.routed_keys[key] = now
            count = self.routed_counts[key] = self.routed_counts.get(key, 0) + 1
            self.shared_keys += count == 2

    def unexpect(self, keys: Sequence[int]) -> None:
        """Undoes one `expect` of these keys: a request counted here that never came (cancelled in Serve's
        queue, or sent elsewhere)."""
        for key in keys:
            count = self.routed_counts.get(key, 0) - 1
            self.shared_keys -= count == 1
            if count > 0:
                self.routed_counts[key] = count
            else:
                self.routed_counts.pop(key, None)
                self.routed_keys.pop(key, None)
                self.pending.pop(key, None)

    def give_up(self, keys: Sequence[int]) -> None:
        """This router stops counting the prompt's own prefix here (it moves to another replica): its keys
        sent here no more often than its deepest one, not the blocks it shares with other prompts (a
        system prompt ahead of it, sent here more often), which stay."""
        own = next((self.routed_counts[k] for k in reversed(keys) if k in self.routed_counts), 0)
        for key in keys:
            if self.routed_counts.get(key, 0) <= own:
                self.pending.pop(key, None)
                self.routed_keys.pop(key, None)
                self.shared_keys -= self.routed_counts.pop(key, 0) >= 2

    def overflowing(self, margin: float) -> bool:
        """The prefixes routed here again and again lately need more blocks than `margin` of its pool."""
        return self.num_blocks > 0 and self.shared_keys > margin * self.num_blocks

    def affinity(self, keys: Sequence[int], matched: int) -> int:
        """Requests routed here lately that carried the last of the prompt's `matched` leading blocks."""
        return self.routed_counts.get(keys[matched - 1], 0) if matched else 0

    def expire(self, now: float, ttl: float) -> None:
        if self.pending:
            self.pending = {k: t for k, t in self.pending.items() if now - t <= ttl}
        if self.routed_keys:
            self.routed_keys = {k: t for k, t in self.routed_keys.items() if now - t <= ttl}
            self.routed_counts = {k: n for k, n in self.routed_counts.items() if k in self.routed_keys}
            self.shared_keys = sum(n >= 2 for n in self.routed_counts.values())


RELEASED_KEPT = 4096  # ended calls remembered before `release` itself prunes the old ones


class Router:
    """Chooses a replica per request under one policy. One event loop decides; the counts of requests in
    flight may change from another thread too (a call's end, `release`)."""

    def __init__(
        self,
        policy: str = "kv",
        block_size: int = 16,
        *,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        pending_ttl: float = DEFAULT_PENDING_TTL,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy, self.block_size = policy, block_size
        self.imbalance_threshold, self.pending_ttl = imbalance_threshold, pending_ttl
        self.replicas: dict[str, ReplicaState] = {}
        # replica -> when (wall clock, as reports are timed) a failed call showed it dead or unreachable
        self.lost: dict[str, float] = {}
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, outcome) -> count
        self._rng = random.Random(seed)
        self._turn = 0  # requests routed: round-robin's position
        self._clock = clock
        self._last_expiry = 0.0
        self.unsent: dict[str, Decision] = {}  # call id -> its decision, until a replica takes the call
        self._released: dict[str, float] = {}  # call id -> when it ended (kept for pending_ttl)
        self._released_limit = RELEASED_KEPT
        # the counts change on the routing loop and, for a call that ends, on the ingress's (the same loop
        # with Serve's direct ingress; two threads behind Serve's proxy)
        self._lock = threading.Lock()

    # ---- membership and reports -------------------------------------------------------------------

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        """The replicas that may be chosen now (Serve's view, less those lost); state is kept for those that
        stay."""
        self.lost = {rid: t for rid, t in self.lost.items() if rid in replica_ids}  # Serve dropped the others
        self.replicas = {
            rid: self.replicas.get(rid) or ReplicaState(rid) for rid in replica_ids if rid not in self.lost
        }

    def replica_lost(self, replica_id: str) -> None:
        """A call or feed to `replica_id` failed because it died or cannot be reached: it is neither chosen
        nor counted from now on, before Serve's controller notices (a replica that Serve starts again has a
        new id), unless a report it makes after this shows it alive (`report`)."""
        self.lost[replica_id] = time.time()
        self.replicas.pop(replica_id, None)

    def report(self, report: ReplicaReport) -> None:
        lost_at = self.lost.get(report.replica_id)
        if lost_at is not None:
            if report.time <= lost_at:  # made before it was lost: says nothing of whether it lives
                return
            del self.lost[report.replica_id]  # unreachable for a while only: it reports again
            self.replicas[report.replica_id] = ReplicaState(report.replica_id)
        state = self.replicas.get(report.replica_id)
        if state is not None:
            with self._lock:  # `unrouted` changes the same maps, from the ingress's thread behind Serve's proxy
                state.apply(report)

    def forget_cache(self, replica_id: str) -> None:
        """A replica restarted: whatever it cached is gone."""
        state = self.replicas.get(replica_id)
        if state is not None:
            with self._lock:
                state.held, state.pending, state.routed_keys, state.routed_counts = set(), {}, {}, {}
                state.shared_keys = 0

    # ---- routing ----------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The keys of the prompt's full blocks that a replica could hit (never the one holding its last
        token, which the engine always computes)."""
        return extend_block_keys([], token_ids, self.block_size, cache_salt, (len(token_ids) - 1) // self.block_size)

    def choose(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        use_cache: bool = True,
        exclude: Sequence[str] = (),
    ) -> Decision:
        """Picks a replica for a prompt and counts it as in flight there (call `finished` when it ends)."""
        decision = self.decide(token_ids, cache_salt=cache_salt, use_cache=use_cache, exclude=exclude)
        self.routed(decision, decision.replica_id)
        self.arrived(decision, decision.replica_id)
        return decision

    def decide(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        use_cache: bool = True,
        exclude: Sequence[str] = (),
    ) -> Decision:
        """Where a prompt should go, changing nothing (Ray Serve may ask again before it sends)."""
        candidates = [s for rid, s in self.replicas.items() if rid not in exclude]
        if not candidates:
            raise LookupError("no replica to route to")
        keys = self.block_keys(token_ids, cache_salt) if use_cache else []
        now = self._clock()
        source = None  # the replica a rebalanced prefix leaves
        if self.policy == "round-robin":
            state, outcome = candidates[self._turn % len(candidates)], "baseline"
        elif self.policy == "pow2":
            pair = self._rng.sample(candidates, 2) if len(candidates) > 1 else candidates
            state, outcome = min(pair, key=lambda s: s.load), "baseline"
        else:
            state, outcome, source = self._choose_kv(candidates, keys, now)
        return Decision(
            state.replica_id, self.policy, outcome, state.matched(keys, now, self.pending_ttl), len(keys), keys, source
        )

    def routed(self, decision: Decision, replica_id: str) -> None:
        """The request of `decision` is on its way to `replica_id` (Ray may pick another when the chosen one
        is full or gone): counted in flight there, its keys expected there."""
        now = self._clock()
        with self._lock:
            self._turn += replica_id == decision.replica_id  # a redirect is the same request, not another turn
            decision.routed_at = now
            state = self.replicas.get(replica_id)
            if state is not None:
                state.inflight += 1
                state.expect(decision.keys, now)
        self._expire(now)

    def arrived(self, decision: Decision, replica_id: str) -> None:
        """A replica took the request: its decision is counted (a 'redirect' where Ray sent it elsewhere than
        chosen), and a rebalanced prefix leaves its old replica (not when routed: a call cancelled in Serve's
        queue, or sent elsewhere, moves nothing and counts nowhere, so the counts only ever grow)."""
        with self._lock:
            outcome = decision.outcome if replica_id == decision.replica_id else "redirect"
            self.decisions[(self.policy, outcome)] += 1
            source = self.replicas.get(decision.moved_from or "")
            if source is not None and replica_id == decision.replica_id:
                source.give_up(decision.keys)

    def unrouted(self, decision: Decision) -> None:
        """Undoes `routed` for a request that never reached the replica it was counted on (cancelled in
        Serve's queue, or moved to another). Its keys' counts there are taken back unless they have expired
        since (then what counts them now is newer requests)."""
        with self._lock:
            self._finished(decision.replica_id)
            state = self.replicas.get(decision.replica_id)
            if state is not None and self._clock() - decision.routed_at <= self.pending_ttl:
                state.unexpect(decision.keys)

    # ---- a call between its decision and a replica taking it (Ray Serve's queue, refusals) ----------

    def hold(self, call_id: str, decision: Decision) -> None:
        """`decision`, routed (counted on its replica), waits for a replica to take the call `call_id`
        (unless that call has ended already: behind Serve's proxy the routing loop is another thread)."""
        with self._lock:  # beside `release`, which may run on another thread (behind Serve's proxy)
            released = call_id in self._released
            if not released:
                self.unsent[call_id] = decision
        if released:
            self.unrouted(decision)

    def taken(self, call_id: str) -> Decision | None:
        """A replica took the call: its decision, which no longer waits."""
        return self.unsent.pop(call_id, None)

    def release(self, call_id: str) -> None:
        """The call ended: if no replica ever took it (cancelled while Serve queued it, refused), its
        decision counts nowhere any more."""
        with self._lock:  # beside `_expire`'s pruning, which may run on the routing thread
            now = self._clock()
            self._released[call_id] = now
            decision = self.unsent.pop(call_id, None)
            if len(self._released) > self._released_limit:  # no routing prunes them (pow2 keeps no decisions)
                self._released = {c: t for c, t in self._released.items() if now - t <= self.pending_ttl}
                self._released_limit = max(RELEASED_KEPT, 2 * len(self._released))  # amortized: O(1) a call
        if decision is not None:
            self.unrouted(decision)

    def _choose_kv(
        self, candidates: list[ReplicaState], keys: list[int], now: float
    ) -> tuple[ReplicaState, str, str | None]:
        """(replica, outcome, the replica a rebalanced prefix leaves)."""
        least = min(candidates, key=lambda s: s.load)
        within = [s for s in candidates if s.load - least.load <= self.imbalance_threshold]
        scored = [(s.matched(keys, now, self.pending_ttl), s) for s in candidates]
        best_match = max(m for m, _ in scored)
        if best_match == 0:  # a new prefix: where the least went lately, among those not too loaded
            return min(within, key=lambda s: (len(s.routed_keys), s.load)), "miss", None
        holders = [s for m, s in scored if m == best_match]
        near = min(s.load for s in holders) + self.imbalance_threshold // 2  # loads this close count as equal
        best = min(
            (s for s in holders if s.load <= near),
            key=lambda s: (-s.affinity(keys, best_match), s.load, -s.free_blocks),
        )
        if best.load - least.load > self.imbalance_threshold:
            return least, "fallback", None
        # tenants placed unevenly: one of the prefixes sent there again and again moves where it fits (its
        # room counted with the keys sent there that no report has confirmed yet, moved prefixes among them)
        if best.overflowing(OVERFLOW_MARGIN) and best.affinity(keys, best_match) >= 2:
            roomy = [
                s
                for s in within
                if s is not best and s.shared_keys + len(s.pending) + len(keys) <= OVERFLOW_MARGIN * s.num_blocks
            ]
            if roomy:
                return min(roomy, key=lambda s: (s.shared_keys, s.load)), "rebalance", best.replica_id
        return best, "hit", None

    def finished(self, replica_id: str) -> None:
        """A request routed to `replica_id` ended (any way)."""
        with self._lock:
            self._finished(replica_id)

    def _finished(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def _expire(self, now: float) -> None:
        if now - self._last_expiry > self.pending_ttl:
            self._last_expiry = now
            with self._lock:
                self._released = {c: t for c, t in self._released.items() if now - t <= self.pending_ttl}
                for state in self.replicas.values():
                    state.expire(now, self.pending_ttl)


def report_from(replica_id: str, blocks: BlockManager, running: int, waiting: int, **optional) -> ReplicaReport:
    """A replica's report from its block manager: every key its prefix cache holds (at most one a block),
    its load, and `optional` (ReplicaReport's optional fields)."""
    return ReplicaReport(
        replica_id, list(blocks.cached), running, waiting, blocks.num_free_blocks, blocks.num_blocks, **optional
    )
