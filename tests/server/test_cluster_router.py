"""The cluster's router as plain Python: block keys from the engine's hash chain, the three policies."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from model.sampling import SamplingParams
from server.cluster.router import ReplicaReport, Router, report_from
from server.engine.block_manager import BlockManager
from server.engine.counters import EngineCounters, SpecDecodeCounters
from server.engine.request import Request

BS = 4


def _prompt(tenant: int, suffix: int, blocks: int = 4) -> list[int]:
    return [100 * tenant + i for i in range(blocks * BS)] + [9000 + suffix]


def _router(policy: str = "kv", n: int = 3, **kw) -> Router:
    router = Router(policy, BS, seed=0, **kw)
    router.set_replicas([f"r{i}" for i in range(n)])
    return router


def _report(rid: str, keys=(), running=0, waiting=0, free=100) -> ReplicaReport:
    return ReplicaReport(rid, list(keys), running, waiting, free, 100)


def test_router_keys_equal_the_block_managers_for_the_same_prompt_and_salt():
    blocks = BlockManager(32, BS)
    for salt in (None, "tenant-a"):
        req = Request(_prompt(1, 0), SamplingParams(), 0, print, cache_salt=salt)
        blocks.admit(req, [])
        req.num_computed = req.num_tokens
        blocks.register_full_blocks(req)
        assert Router("kv", BS).block_keys(req.token_ids, salt) == blocks.block_hashes(req, 4)
    assert Router("kv", BS).block_keys(_prompt(1, 0), "a") != Router("kv", BS).block_keys(_prompt(1, 0), "b")


def test_report_from_a_block_manager_makes_the_router_send_a_repeat_to_that_replica():
    blocks = BlockManager(32, BS)
    req = Request(_prompt(2, 0), SamplingParams(), 0, print)
    blocks.admit(req, [])
    req.num_computed = req.num_tokens
    blocks.register_full_blocks(req)
    blocks.release(req)
    router = Router("kv", BS, seed=0, pending_ttl=0)  # no memory of its own: only the report counts
    router.set_replicas(["a", "b", "c"])
    router.report(report_from("b", blocks, running=0, waiting=0))
    for suffix in range(5):
        decision = router.choose(_prompt(2, suffix + 1))
        assert (decision.replica_id, decision.outcome, decision.matched_blocks) == ("b", "hit", 4)
        router.finished("b")


def test_kv_sends_every_repeat_of_a_tenant_where_its_first_request_went():
    router = _router("kv", n=4)
    first = {}
    for rnd in range(5):
        for tenant in (3, 1, 0, 2):
            d = router.choose(_prompt(tenant, rnd))
            first.setdefault(tenant, d.replica_id)
            assert d.replica_id == first[tenant], f"tenant {tenant} moved on round {rnd}"
            assert d.outcome == ("miss" if rnd == 0 else "hit")
            router.finished(d.replica_id)
    assert len(set(first.values())) == 4, f"four new tenants on four idle replicas went to {first}"


def test_kv_prefers_the_least_loaded_replica_once_the_imbalance_passes_the_threshold():
    router = _router("kv", n=2, imbalance_threshold=2)
    router.report(_report("r0", router.block_keys(_prompt(5, 0)), running=2))
    assert router.choose(_prompt(5, 1)).replica_id == "r0"  # load 2 -> 3 with this one, r1 has 0: gap 2
    router.report(_report("r0", router.block_keys(_prompt(5, 0)), running=3))
    d = router.choose(_prompt(5, 2))
    assert (d.replica_id, d.outcome) == ("r1", "fallback"), d
    assert router.decisions[("kv", "fallback")] == 1 and router.decisions[("kv", "hit")] == 1


def test_after_a_fallback_a_tenant_goes_home_again_not_to_the_copy_the_fallback_left():
    """Both replicas now hold the prefix; the next requests go where it was sent most, even when the
    other is less loaded, so the fallback's copy is not reused and is evicted first."""
    router = _router("kv", n=2, imbalance_threshold=2)
    home = router.choose(_prompt(5, 0)).replica_id
    for suffix in (1, 2):
        assert router.choose(_prompt(5, suffix)).replica_id == home  # three in flight at home now
    d = router.choose(_prompt(5, 3))
    away = d.replica_id
    assert (away != home, d.outcome) == (True, "fallback"), d
    for _ in range(3):
        router.finished(home)  # home: 0 in flight, away: 1
    router.report(_report(away, router.block_keys(_prompt(5, 0)), running=1))  # away holds the prefix too,
    router.report(_report(home, router.block_keys(_prompt(5, 0)), running=2))  # and is less loaded than home
    d = router.choose(_prompt(5, 4))
    assert (d.replica_id, d.outcome) == (home, "hit"), d


def test_tenants_that_overflow_one_replicas_cache_move_one_by_one_to_a_replica_with_room():
    """Five tenants landed on r0 while it was the only replica (a startup); its pool holds 20 blocks, their
    prefixes 4 each. Once r1 is there, one prefix moves (a miss there, once) and stays; the rest stay home."""
    router = _router("kv", n=1)
    held = []
    for tenant in range(5):
        for suffix in (0, 1):
            assert router.choose(_prompt(tenant, suffix)).replica_id == "r0"
            router.finished("r0")
        held += router.block_keys(_prompt(tenant, 0))
    router.set_replicas(["r0", "r1"])
    router.report(ReplicaReport("r0", held, 0, 0, 20, 20))
    router.report(ReplicaReport("r1", [], 0, 0, 20, 20))
    d = router.choose(_prompt(3, 2))
    assert (d.replica_id, d.outcome) == ("r1", "rebalance"), d
    router.finished("r1")
    for suffix in (3, 4):
        d = router.choose(_prompt(3, suffix))  # both caches hold tenant 3 now: it stays on r1
        assert (d.replica_id, d.outcome) == ("r1", "hit"), d
        router.finished("r1")
    for tenant in (0, 1, 2, 4):  # r0's four prefixes fit its pool: they stay
        d = router.choose(_prompt(tenant, 5))
        assert (d.replica_id, d.outcome) == ("r0", "hit"), (tenant, d)
        router.finished("r0")
    assert router.decisions[("kv", "rebalance")] == 1


def test_a_rebalance_no_replica_took_moves_nothing():
    """Decided and counted as the Ray adapter does, then cancelled in Serve's queue: the prefix still lives
    on r0, so the next request of that tenant is a rebalance again, not a 'hit' on a replica that never
    computed it."""
    router = _router("kv", n=1)
    held = []
    for tenant in range(5):
        for suffix in (0, 1):
            router.finished(router.choose(_prompt(tenant, suffix)).replica_id)
        held += router.block_keys(_prompt(tenant, 0))
    router.set_replicas(["r0", "r1"])
    router.report(ReplicaReport("r0", held, 0, 0, 20, 20))
    router.report(ReplicaReport("r1", [], 0, 0, 20, 20))
    d = router.decide(_prompt(3, 2))
    router.routed(d, d.replica_id)
    router.hold("call-1", d)
    router.release("call-1")  # cancelled before any replica took it
    assert d.outcome == "rebalance" and router.replicas["r0"].affinity(d.keys, len(d.keys)) == 2
    again = router.choose(_prompt(3, 3))
    assert (again.replica_id, again.outcome) == ("r1", "rebalance"), again
    assert router.replicas["r0"].affinity(d.keys, len(d.keys)) == 0  # taken this time: the prefix left r0


def test_a_new_prefix_goes_where_the_smallest_working_set_was_routed_unless_that_replica_is_too_loaded():
    router = _router("kv", n=2, imbalance_threshold=2)
    placed = {}
    for tenant in (1, 2, 3):  # new prefixes alternate: 4 blocks to one, 4 to the other, then a tie
        placed[tenant] = router.choose(_prompt(tenant, 0)).replica_id
        router.finished(placed[tenant])
    busy, quiet = placed[1], placed[2]
    assert busy != quiet and placed[3] == busy
    for suffix in (1, 2):  # more traffic to the quiet one, on the prefix it has: its working set stays 4 blocks
        assert router.choose(_prompt(2, suffix)).replica_id == quiet
        router.finished(quiet)
    # reports: the busy replica's cache holds its 8 blocks; the quiet one's is full of older blocks
    router.report(_report(busy, router.block_keys(_prompt(1, 0)) + router.block_keys(_prompt(3, 0))))
    router.report(_report(quiet, range(10**6, 10**6 + 60)))
    d = router.choose(_prompt(4, 0))  # routed lately: 8 blocks in 2 requests to busy, 4 in 3 to quiet
    assert (d.replica_id, d.outcome) == (quiet, "miss")
    router.finished(quiet)
    router.report(_report(quiet, range(10**6, 10**6 + 60), running=3))  # past the threshold: load wins
    assert router.choose(_prompt(5, 0)).replica_id == busy


def test_round_robin_takes_replicas_in_turn_whatever_they_cache():
    router = _router("round-robin", n=3)
    assert [router.choose(_prompt(1, i)).replica_id for i in range(6)] == ["r0", "r1", "r2"] * 2


def test_pow2_picks_the_less_loaded_of_two():
    router = _router("pow2", n=2)
    router.report(_report("r0", running=10))
    assert {router.choose(_prompt(1, i)).replica_id for i in range(5)} == {"r1"}


def test_a_restarted_replica_loses_its_believed_cache_and_an_excluded_one_is_skipped():
    router = _router("kv", n=2)
    rid = router.choose(_prompt(7, 0)).replica_id
    router.forget_cache(rid)
    router.finished(rid)
    assert router.choose(_prompt(7, 1)).outcome == "miss"
    other = router.choose(_prompt(8, 0), exclude=[rid]).replica_id
    assert other != rid
    with pytest.raises(LookupError):
        router.choose(_prompt(8, 1), exclude=["r0", "r1"])


def test_a_replica_a_failure_showed_gone_is_not_chosen_until_serve_drops_it_or_it_reports_again():
    """What the ingress saw fail (a stream or feed cut by its replica's death) leaves the router at once,
    though Serve still lists it; a report it makes afterwards brings it back (it was unreachable for a
    while only); one made before does not."""
    router = _router("kv", n=2)
    before = dataclasses.replace(_report("r0"), time=0.0)
    router.replica_lost("r0")
    router.set_replicas(["r0", "r1"])  # Serve's view, not yet updated
    assert list(router.replicas) == ["r1"] and router.choose(_prompt(1, 0)).replica_id == "r1"
    router.report(before)
    assert list(router.replicas) == ["r1"]
    router.report(dataclasses.replace(_report("r0"), time=router.lost["r0"] + 1))  # made after the failure
    assert sorted(router.replicas) == ["r0", "r1"]
    router.replica_lost("r1")
    router.set_replicas(["r0", "r2"])  # Serve dropped it and started another: nothing left to remember
    assert sorted(router.replicas) == ["r0", "r2"] and router.lost == {}


def test_a_call_taken_back_after_its_counts_expired_leaves_a_newer_requests_counts_alone():
    """A call that waited in Serve's queue past the pending TTL: its keys' counts have expired, and a newer
    request with the same prefix counts them now; cancelling the old call takes nothing from the new one."""
    now = [0.0]
    router = _router("kv", n=1, clock=lambda: now[0])
    old = router.decide(_prompt(3, 0))
    router.routed(old, old.replica_id)
    router.hold("old", old)
    now[0] = router.pending_ttl + 5
    other = router.decide(_prompt(4, 0))
    router.routed(other, other.replica_id)  # a routing: the old call's counts expire
    new = router.decide(_prompt(3, 1))
    router.routed(new, new.replica_id)
    router.release("old")  # cancelled in Serve's queue at last
    state = router.replicas[new.replica_id]
    assert state.inflight == 2 and state.matched(new.keys, now[0], router.pending_ttl) == len(new.keys) > 0


def test_a_request_that_never_reached_its_replica_is_uncounted_and_a_redirect_moves_it():
    """As Ray Serve drives it: decided and routed (in flight there, its prefix expected there), then taken by
    a replica (`arrived`: the decision counts) or not. One that never arrives leaves no trace: neither a
    count, which would then have to go down (a Prometheus counter), nor a prefix its replica never computed."""
    router = _router("kv", n=2, clock=lambda: 100.0)
    prompt = _prompt(3, 0)
    decision = router.decide(prompt)
    router.routed(decision, decision.replica_id)
    chosen = router.replicas[decision.replica_id]
    assert chosen.inflight == 1 and chosen.matched(decision.keys, 100.0, 30.0) == len(decision.keys) > 0
    assert not router.decisions  # counted once a replica takes it
    router.unrouted(decision)  # cancelled in Serve's queue
    assert all(s.inflight == 0 for s in router.replicas.values()) and not router.decisions
    assert chosen.matched(decision.keys, 100.0, 30.0) == 0 and not chosen.routed_counts and chosen.shared_keys == 0
    decision = router.decide(prompt)
    other = next(rid for rid in router.replicas if rid != decision.replica_id)
    router.routed(decision, decision.replica_id)
    router.unrouted(decision)  # Serve sent it to the other replica
    router.routed(decision, other)
    router.arrived(decision, other)
    assert (router.replicas[other].inflight, router.replicas[decision.replica_id].inflight) == (1, 0)
    assert dict(router.decisions) == {("kv", "redirect"): 1}
    assert router.replicas[other].matched(decision.keys, 100.0, 30.0) == len(decision.keys)
    assert router.replicas[decision.replica_id].matched(decision.keys, 100.0, 30.0) == 0
    router.finished(other)
    assert router.replicas[other].inflight == 0
    # a call held between its decision and a replica taking it: released at its end unless taken
    waiting, taken = router.choose(_prompt(4, 0)), router.choose(_prompt(5, 0))
    router.hold("call-a", waiting)
    router.hold("call-b", taken)
    assert router.taken("call-b") is taken and sum(s.inflight for s in router.replicas.values()) == 2
    router.release("call-a")
    router.release("call-b")  # taken: it stays in flight until it finishes
    assert sum(s.inflight for s in router.replicas.values()) == 1 and not router.unsent


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round-robin"):
        Router("random")


def test_the_routing_simulator_finds_kv_routing_hits_more_than_round_robin_and_the_oracle_no_less_than_kv():
    from bench.routing_sim import CostModel, make_trace, simulate

    trace = make_trace(num_requests=60, rate=40.0, tenants=8, zipf_s=1.0, output_tokens=4, seed=1)
    run = dict(
        cost=CostModel(1e-3, 3e-4, 1e-4),
        num_blocks=128,
        block_size=16,
        max_num_seqs=16,
        max_batched=128,
        report_interval=0.5,
        imbalance_threshold=8,
        seed=1,
    )
    hit = {p: simulate(trace, p, 3, **run).hit_rate for p in ("kv", "oracle", "round-robin")}
    assert hit["kv"] > hit["round-robin"] + 0.1, hit
    assert hit["oracle"] >= hit["kv"] - 0.05, hit


def test_the_routing_benchmark_reports_the_ttft_of_hits_and_of_misses_apart():
    from bench.cluster import _summary

    def request(ttft_s: float, cached: int | None, ok: bool = True) -> dict:
        return {"ok": ok, "ttft_s": ttft_s, "cached_tokens": cached}

    stats = {"p50": 0.02, "p99": 0.05, "mean": 0.03, "p90": 0.04}
    run = {
        "label": "c=4 prefix",
        "requests_ok": 5,
        "requests_failed": 1,
        "prefix_cache_hit_rate": 0.5,
        "output_tokens_per_s": 100.0,
        "ttft_s": stats,
        "itl_s": stats,
        "requests": [
            request(0.010, 256),
            request(0.030, 16),
            request(0.060, 0),
            request(0.080, 0),
            request(0.070, 0),
            request(0.001, 256, ok=False),
        ],
    }
    summary = _summary(run)
    assert summary["requests_hitting"] == 2 / 5
    assert (summary["ttft_hit_p50_ms"], summary["ttft_miss_p50_ms"]) == (20.0, 70.0)
    run["requests"] = [request(0.010, 256)]
    assert (_summary(run)["requests_hitting"], _summary(run)["ttft_miss_p50_ms"]) == (1.0, None)


def test_the_ray_adapter_counts_a_taken_request_down_by_its_result_whichever_report_comes_first():
    """Serve reports a request taken (`on_request_routed`) after its replica accepted it, and on its actor
    transport the request may have finished by then: the result's own callback, which fires at once for a
    finished result, counts it down either way."""
    pytest.importorskip("ray.serve")
    import asyncio

    from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from server.cluster.protocol import Submission
    from server.cluster.ray_router import KVCacheRequestRouter

    class Result:  # what Serve hands the hook: done now, or later
        def __init__(self, done: bool) -> None:
            self.done, self.callbacks = done, []

        def add_done_callback(self, callback) -> None:
            callback(self) if self.done else self.callbacks.append(callback)

    async def scenario(done_first: bool) -> list[int]:
        adapter = object.__new__(KVCacheRequestRouter)  # the hooks under test, without a Serve deployment
        deployment = DeploymentID(name="EngineReplica", app_name="test")
        adapter._deployment_id = deployment
        adapter.initialize_state(policy="kv", block_size=BS)
        core = adapter.router
        core.set_replicas(["r0", "r1"])
        sub = Submission(["call-1"], _prompt(1, 0), [SamplingParams(max_new_tokens=1)], True, None, True)
        decision = core.choose(sub.prompt_ids)
        core.hold("call-1", decision)
        other = next(rid for rid in core.replicas if rid != decision.replica_id)  # Serve sent it elsewhere
        pending = PendingRequest(args=[sub], kwargs={}, metadata=RequestMetadata("r", "internal-1"))
        result = Result(done=done_first)
        adapter.on_request_completed(ReplicaID(other, deployment), "internal-1")  # Serve's report, first
        adapter.on_request_routed(pending, ReplicaID(other, deployment), result)
        counts = [core.replicas[decision.replica_id].inflight, core.replicas[other].inflight]
        for callback in result.callbacks:
            callback(result)
        core.release("call-1")  # the call ends
        return counts + [core.replicas[other].inflight, core.decisions[("kv", "redirect")]]

    assert asyncio.run(scenario(done_first=True)) == [0, 0, 0, 1]
    assert asyncio.run(scenario(done_first=False)) == [0, 1, 0, 1]


def test_the_ray_adapter_sends_a_feed_to_its_replica_under_every_policy_and_pow2_hands_serve_two():
    """An ingress's feed goes to the replica it names (any while that one is gone: it refuses the feed);
    pow2 hands Serve two distinct replicas as one rank, of which Serve's probes take the shorter queue."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from server.cluster.protocol import FeedRequest, Submission
    from server.cluster.ray_router import KVCacheRequestRouter
    from server.cluster.router import POLICIES

    deployment = DeploymentID(name="EngineReplica", app_name="test")
    replicas = [SimpleNamespace(replica_id=ReplicaID(f"r{i}", deployment), routing_stats={}) for i in range(3)]

    def ask(adapter, arg) -> list[list[str]]:
        async def choose():
            pending = PendingRequest(args=[arg], kwargs={}, metadata=RequestMetadata("r", f"internal-{id(arg)}"))
            return await adapter.choose_replicas(replicas, pending)

        return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(choose())]

    for policy in POLICIES:
        adapter = object.__new__(KVCacheRequestRouter)
        adapter._deployment_id = deployment
        adapter.initialize_state(policy=policy, block_size=BS)
        for target in ("r0", "r1", "r2"):
            assert ask(adapter, FeedRequest("ingress-1", target, "feed-1")) == [[target]], policy
        # its replica gone: any (which refuses it), never none (a routing no replica takes blocks Serve's)
        assert ask(adapter, FeedRequest("ingress-1", "r9", "feed-2")) == [["r0", "r1", "r2"]], policy
        if policy == "pow2":
            for k in range(20):
                sub = Submission([f"call-{k}"], _prompt(k, 0), [SamplingParams(max_new_tokens=1)], True, None)
                (rank,) = ask(adapter, sub)
                assert len(rank) == len(set(rank)) == 2 and set(rank) <= {"r0", "r1", "r2"}


def test_ended_calls_are_forgotten_after_their_ttl_even_where_no_routing_prunes_them():
    """pow2 hands the choice to Serve and keeps no decisions, so only `release` sees its calls end: what
    it remembers stays bounded (each call's end is kept for pending_ttl, for a routing that comes late)."""
    now = [0.0]
    router = Router("pow2", BS, pending_ttl=1.0, clock=lambda: now[0])
    for k in range(20_000):
        now[0] = k * 0.001  # 1,000 calls a second
        router.release(f"call-{k}")
    assert len(router._released) <= 4096 and "call-19999" in router._released


def test_a_replicas_step_histograms_cross_in_its_report_and_sum_over_replicas():
    from server.engine.step_budget import StepWork
    from server.engine.step_stats import StepStats, merged

    snapshots = []
    for steps in ([(StepWork(3, 30, 0), 0.002)], [(StepWork(1, 10, 16), 0.004), (StepWork(2, 20, 0), 0.0007)]):
        stats = StepStats()
        for work, seconds in steps:
            stats.observe(work, seconds)
        report = _report(f"r{len(snapshots)}")
        report.step_stats = stats.snapshot(None, 128, 16)
        snapshots.append(ReplicaReport.from_stats(report.to_stats()).step_stats)  # as Ray Serve relays it
    total = merged(snapshots, None, 128)
    assert (total.step_seconds.count, total.decode_tokens.total, total.prompt_tokens.total) == (3, 6, 16)
    assert total.step_seconds.total == pytest.approx(0.0067)
    assert [sum(total.step_seconds.counts[:i]) for i in (1, 2, 3, 4)] == [0, 1, 2, 3]  # to 0.5, 1, 2.5, 5 ms
    assert total.prompt_allowance == 32 and total.max_batched_tokens == 128
    empty = merged([], 0.05, 64)
    assert (empty.step_seconds.count, empty.target_step_s, empty.max_batched_tokens) == (0, 0.05, 64)
    assert len(empty.decode_tokens.counts) == len(empty.decode_tokens.buckets) + 1


def _builtins_only(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _builtins_only(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(map(_builtins_only, value))
    return value is None or type(value) in (bool, int, float, str)


def test_a_report_crosses_as_builtins_by_field_name_and_comes_back_with_every_field():
    from server.engine.step_budget import StepWork
    from server.engine.step_stats import StepStats

    stats = StepStats()
    stats.observe(StepWork(2, 20, 8), 0.003)
    report = ReplicaReport(
        "r7",
        [11, -12],
        3,
        4,
        5,
        60,
        time=123.5,
        counters=EngineCounters(
            prefix_cache_queries=7,
            prefix_cache_hits=6,
            num_preemptions=2,
            spec_decode=SpecDecodeCounters(
                num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2, num_accepted_tokens_per_pos=(1, 1)
            ),
        ),
        kv_cache_usage=0.25,
        pid=99,
        kernels="exact",
        step_stats=stats.snapshot(0.05, 128, 16),
    )
    blank = ReplicaReport("", [], 0, 0, 0, 0, time=0.0)
    assert all(getattr(report, f.name) != getattr(blank, f.name) for f in dataclasses.fields(ReplicaReport)), (
        "set every field of the report here, so that the round trip below checks it"
    )
    wire = report.to_stats()
    assert set(wire) == {"kvserve_report"}
    assert set(wire["kvserve_report"]) == {f.name for f in dataclasses.fields(ReplicaReport)}
    assert _builtins_only(wire), "Serve's controller relays it and must unpickle it without our modules"
    assert ReplicaReport.from_stats(pickle.loads(pickle.dumps(wire))) == report
    assert ReplicaReport.from_stats({}) is None and ReplicaReport.from_stats(None) is None
