"""The load-test tool: metrics from synthetic timestamps (exact), and a short run against the real server."""

from __future__ import annotations

import pytest

from loadtest.client import LoadTestConfig, RequestParams, run_labels
from loadtest.prompts import BUILTIN_PASSAGE, build_prompts
from loadtest.report import (
    RequestRecord,
    cache_ratio,
    distribution,
    itl_by_token_index,
    percentile,
    render_tables,
    summarize,
)


def record(start, token_times, end, ok=True, error_type=None):
    return RequestRecord(
        start=start,
        token_times=list(token_times),
        end=end,
        ok=ok,
        error_type=error_type,
        finish_reason="length" if ok else None,
    )


def test_tpot_spreads_decode_time_over_tokens_after_the_first():
    r = record(10.0, [10.5, 10.75, 11.0, 11.5], 11.5)
    assert r.ttft == 0.5
    assert r.e2e == 1.5
    assert r.tpot == (1.5 - 0.5) / 3


def test_itl_is_every_gap_between_consecutive_tokens():
    r = record(0.0, [0.5, 0.75, 1.0, 1.5], 1.5)
    assert r.itls() == [0.25, 0.25, 0.5]


def test_tpot_is_undefined_for_a_single_token():
    r = record(0.0, [0.25], 0.25)
    assert r.output_tokens == 1 and r.tpot is None and r.itls() == []


def test_percentiles_interpolate_between_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile(values, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile([7.0], 99) == 7.0
    assert distribution(values) == {
        "mean": 2.5,
        "p50": 2.5,
        "p90": pytest.approx(3.7),
        "p99": pytest.approx(3.97),
        "count": 4,
    }
    assert distribution([])["p50"] is None


def test_summary_averages_tpot_per_request_but_pools_itl_gaps():
    fast = record(0.0, [1.0, 1.25, 1.5, 1.75, 2.0], 2.0)  # 4 gaps of 0.25 s
    slow = record(0.0, [1.0, 3.0], 3.0)  # 1 gap of 2 s
    failed = record(0.0, [], None, ok=False, error_type="http_429")
    s = summarize([fast, slow, failed], wall_s=4.0, concurrency=2, use_cache=True)
    assert (s["requests_ok"], s["requests_failed"], s["errors"]) == (2, 1, {"http_429": 1})
    assert s["concurrency"] == 2 and s["use_cache"] is True
    assert s["tpot_s"]["mean"] == (0.25 + 2.0) / 2  # each request weighs the same
    assert s["itl_s"]["mean"] == (4 * 0.25 + 2.0) / 5  # each gap weighs the same
    assert s["itl_s"]["count"] == 5 and s["tpot_s"]["count"] == 2
    assert s["ttft_s"]["mean"] == 1.0
    assert s["e2e_s"]["p50"] == 2.5
    assert s["output_tokens"] == 7
    assert s["output_tokens_per_s"] == 7 / 4.0
    assert s["requests_per_s"] == 2 / 4.0
    assert len(s["requests"]) == 3


def test_itl_by_token_index_averages_over_requests_that_reached_it():
    a = record(0.0, [1.0, 2.0, 4.0], 4.0)  # gaps 1, 2
    b = record(0.0, [1.0, 4.0], 4.0)  # gap 3
    assert itl_by_token_index([a, b]) == [2.0, 2.0]


def test_cache_ratio_is_cache_on_over_cache_off():
    on = summarize([record(0.0, [0.5, 1.0, 1.5], 1.5)], wall_s=1.5)
    off = summarize([record(0.0, [1.0, 2.0, 3.0], 3.0)], wall_s=3.0)
    ratio = cache_ratio(on, off)
    assert ratio["output_tokens_per_s"] == 2.0
    assert ratio["requests_per_s"] == 2.0
    assert ratio["ttft_s"]["p50"] == 0.5
    assert ratio["tpot_s"]["mean"] == 0.5
    assert ratio["itl_s"]["p99"] == 0.5
    assert ratio["e2e_s"]["mean"] == 0.5


def test_tables_show_a_column_per_mode_and_per_comparison():
    on = summarize(
        [record(0.0, [0.5, 1.0], 1.0)], 1.0, label="c=1 prefix", concurrency=1, request_rate=None, cache_mode="prefix"
    )
    off = {**on, "label": "c=1 off", "cache_mode": "off"}
    plain = render_tables({"runs": [on], "cache_ratios": []})
    assert [c.header for c in plain[0].columns] == ["metric", "KV + prefix cache"]
    compared = render_tables(
        {
            "runs": [on, off],
            "cache_ratios": [
                {
                    "concurrency": 1,
                    "request_rate": None,
                    "numerator": "prefix",
                    "denominator": "off",
                    "ratio": cache_ratio(on, off),
                }
            ],
        }
    )
    assert [c.header for c in compared[0].columns] == ["metric", "KV + prefix cache", "no cache", "prefix/off"]


def test_the_hit_rate_is_cached_over_prompt_tokens():
    a, b = record(0.0, [0.5], 1.0), record(0.0, [0.5], 1.0)
    a.prompt_tokens, a.cached_tokens, b.prompt_tokens, b.cached_tokens = 100, 64, 100, 0
    summary = summarize([a, b], 1.0)
    assert (summary["prompt_tokens"], summary["cached_prompt_tokens"], summary["prefix_cache_hit_rate"]) == (
        200,
        64,
        0.32,
    )


def test_speculation_is_acceptance_over_draft_tokens_and_generated_tokens_per_step():
    a, b, c = (record(0.0, [0.5], 1.0) for _ in range(3))
    a.server_generated_tokens, a.draft_tokens, a.accepted_draft_tokens = 40, 30, 20  # 20 steps for 40 tokens
    b.server_generated_tokens, b.draft_tokens, b.accepted_draft_tokens = 40, 10, 0
    c.server_generated_tokens = 20  # a server without speculation sends no draft counts
    summary = summarize([a, b, c], 1.0)
    assert (summary["draft_tokens"], summary["accepted_draft_tokens"]) == (40, 20)
    assert summary["draft_acceptance_rate"] == 0.5 and summary["tokens_per_step"] == 100 / 80
    plain = summarize([c], 1.0)
    assert plain["draft_acceptance_rate"] is None and plain["tokens_per_step"] == 1.0


def test_greedy_request_body_follows_tgi_schema():
    body = RequestParams(max_new_tokens=5, cache_mode="off", ignore_eos=False).body("Hi")
    assert body == {
        "inputs": "Hi",
        "parameters": {"max_new_tokens": 5, "use_cache": False, "details": True, "do_sample": False},
    }
    salts = {RequestParams(cache_mode="kv").body("Hi")["parameters"]["cache_salt"] for _ in range(3)}
    assert len(salts) == 3, "the kv mode needs a fresh salt per request (no prefix reuse across requests)"
    assert "cache_salt" not in RequestParams(cache_mode="prefix").body("Hi")["parameters"]
    sampled = RequestParams(max_new_tokens=5, temperature=0.7).body("Hi")["parameters"]
    assert sampled["do_sample"] is True and sampled["temperature"] == 0.7 and sampled["ignore_eos"] is True


def test_runs_put_cache_modes_side_by_side_per_level():
    labels = run_labels(LoadTestConfig(concurrency=(1, 4), cache_modes=("kv", "off")))
    assert [(r["concurrency"], r["cache_mode"]) for r in labels] == [(1, "kv"), (1, "off"), (4, "kv"), (4, "off")]
    assert labels[0]["label"] == "c=1 kv"
    rates = run_labels(LoadTestConfig(request_rates=(2.5,)))
    assert [(r["concurrency"], r["request_rate"], r["label"]) for r in rates] == [(None, 2.5, "rate=2.5/s prefix")]


def test_prompts_are_cut_to_exact_token_counts(tiny_tokenizer):
    prompts = build_prompts([BUILTIN_PASSAGE], count=5, prompt_tokens=12, tokenizer=tiny_tokenizer, seed=1)
    assert len(prompts) == 5
    assert [len(tiny_tokenizer.encode(p)) for p in prompts] == [12] * 5


# ---- against the real server: the `live` fixture of tests/server/conftest.py (tiny checkpoint, uvicorn) ----


@pytest.fixture(scope="module")
def server_url(live):
    return live.url


def test_load_test_against_real_server_counts_every_token(server_url, tiny_checkpoint, tmp_path):
    import asyncio
    import json

    from loadtest.client import run_load_test
    from loadtest.prompts import load_prompts
    from loadtest.report import write_plots

    prompts, note = load_prompts(4, 8, None, str(tiny_checkpoint), shared_prefix_tokens=40)
    assert note["tokens_max"] >= 40 + 8 and note["shared_prefix_tokens"] == 40
    config = LoadTestConfig(
        url=server_url,
        concurrency=(1, 2),
        cache_modes=("prefix", "kv", "off"),
        num_requests=3,
        max_new_tokens=4,
        request_timeout_s=60,
        timeout_s=240,
    )
    report = asyncio.run(run_load_test(config, prompts))
    assert [r["label"] for r in report["runs"]] == [
        "c=1 prefix",
        "c=1 kv",
        "c=1 off",
        "c=2 prefix",
        "c=2 kv",
        "c=2 off",
    ]
    assert report["server"]["ignore_eos_supported"] is True  # our own server: every request runs to 4 tokens
    for run in report["runs"]:
        assert (run["requests_ok"], run["requests_failed"]) == (3, 0), run["errors"]
        tokens = [r["output_tokens"] for r in run["requests"]]
        assert tokens == [4, 4, 4], tokens
        assert [r["server_generated_tokens"] for r in run["requests"]] == tokens
        assert run["output_tokens"] == sum(tokens)
        assert run["ttft_s"]["count"] == 3 and run["e2e_s"]["count"] == 3
        assert run["itl_s"]["count"] == sum(n - 1 for n in tokens)
        assert len(run["itl_by_token_index_s"]) == max(tokens) - 1
        steps = run["server_steps"]  # the server's step metrics over the run, beside its ITL in the report
        assert (steps["target_step_ms"], steps["max_batched_tokens"]) == (None, 128)
        assert steps["steps"] >= max(tokens) and steps["prompt_tokens_per_step"] > 0
        assert (steps["decode_tokens_per_step"] > 0) == (run["cache_mode"] != "off")  # off: every step recomputes
        hits = [r["cached_tokens"] for r in run["requests"]]
        if run["cache_mode"] == "prefix":
            assert all(h >= 32 for h in hits), hits  # the shared prefix's two full blocks, at least
        else:
            assert hits == [0, 0, 0], hits
    assert [(c["concurrency"], c["numerator"], c["denominator"]) for c in report["cache_ratios"]] == [
        (1, "kv", "off"),
        (2, "kv", "off"),
        (1, "prefix", "off"),
        (2, "prefix", "off"),
        (1, "prefix", "kv"),
        (2, "prefix", "kv"),
    ]
    assert sorted(report["cache_ratios"][0]["ratio"]) == sorted(
        ["output_tokens_per_s", "requests_per_s", "ttft_s", "tpot_s", "itl_s", "e2e_s"]
    )
    json.dumps(report)
    assert [p.name for p in write_plots(report, tmp_path)] == ["throughput_latency.png", "itl_by_token_index.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("throughput_latency.png", "itl_by_token_index.png"))


def test_command_line_writes_json_report(server_url, tiny_checkpoint, tmp_path):
    import json

    from loadtest.client import main

    out = tmp_path / "report.json"
    code = main(
        [
            "--url",
            server_url,
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--max-new-tokens",
            "3",
            "--prompt-tokens",
            "6",
            "--tokenizer",
            str(tiny_checkpoint),
            "--quiet",
            "--json-out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert [(r["concurrency"], r["cache_mode"], r["requests_ok"]) for r in report["runs"]] == [(2, "prefix", 2)]
    assert report["prompts"]["tokens_max"] == 6


def test_a_refused_request_is_recorded_with_the_servers_status_and_error(server_url):
    import asyncio
    import time

    from loadtest.client import make_client, stream_one

    async def send(params: RequestParams) -> RequestRecord:
        async with make_client(30) as client:
            return await stream_one(client, server_url, "Hello there", params, RequestRecord(start=time.perf_counter()))

    refused = asyncio.run(send(RequestParams(max_new_tokens=10**6)))  # past the context: 422 before any event
    assert (refused.status, refused.ok, refused.token_times) == (422, False, [])
    assert refused.error_type == "validation" and "max_new_tokens" in refused.error, refused.error
    served = asyncio.run(send(RequestParams(max_new_tokens=3)))
    assert (served.status, served.ok, len(served.token_times), served.server_generated_tokens) == (200, True, 3, 3)


def test_an_event_line_too_long_to_read_is_a_bad_event_not_a_crash():
    """A loopback server that answers one 3 MiB SSE line (past the client's 1 MiB read buffer)."""
    import asyncio
    import time

    from loadtest.client import make_client, stream_one

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            + b"data: "
            + b"x" * (3 << 20)
            + b"\n\n"
        )
        await writer.drain()
        writer.close()

    async def main() -> RequestRecord:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, make_client(30) as client:
            return await stream_one(
                client,
                f"http://127.0.0.1:{port}",
                "Hi",
                RequestParams(max_new_tokens=2),
                RequestRecord(start=time.perf_counter()),
            )

    record = asyncio.run(main())
    assert (record.status, record.ok, record.error_type) == (200, False, "bad_event"), record.error


def test_unreachable_server_is_reported_not_retried(tiny_checkpoint):
    import socket

    from loadtest.client import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    assert (
        main(
            ["--url", f"http://127.0.0.1:{port}", "--num-requests", "1", "--quiet", "--tokenizer", str(tiny_checkpoint)]
        )
        == 2
    )


def test_tenants_give_each_prompt_one_of_k_shared_prefixes(tiny_checkpoint):
    from loadtest.prompts import load_prompts

    prompts, note = load_prompts(24, 8, None, str(tiny_checkpoint), tenants=3, shared_prefix_tokens=30)
    heads = {p.split("\n", 1)[0] for p in prompts}
    assert len(heads) == 3 and note["tenants"] == 3, heads
    assert all(any(p.startswith(h + "\n") for h in heads) for p in prompts)


def test_a_response_format_workload_sends_tgi_grammars(tmp_path):
    import json

    from loadtest.client import response_grammar

    assert response_grammar(None) is None
    assert response_grammar("json_object") == {"type": "json", "value": {"type": "object"}}
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    grammar = response_grammar(str(path))
    assert grammar == {"type": "json", "value": schema}
    assert RequestParams(grammar=grammar).body("Hi")["parameters"]["grammar"] == grammar
    assert "grammar" not in RequestParams().body("Hi")["parameters"]
    with pytest.raises(ValueError, match="not json_object nor a JSON schema file"):
        response_grammar(str(tmp_path / "missing.json"))


def test_a_response_format_run_against_the_real_server_ends_each_request_with_its_json(live, tiny_checkpoint, tmp_path):
    import asyncio
    import json

    from loadtest.client import run_load_test
    from loadtest.prompts import load_prompts

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "schema.json").write_text(json.dumps({**schema, "additionalProperties": False}))
    prompts, _ = load_prompts(2, 8, None, str(tiny_checkpoint))
    before = live.engine.counters().structured_output.requests
    config = LoadTestConfig(
        url=live.url, num_requests=3, max_new_tokens=32, response_format=str(tmp_path / "schema.json"), timeout_s=120
    )
    report = asyncio.run(run_load_test(config, prompts))
    (run,) = report["runs"]
    assert (run["requests_ok"], run["requests_failed"]) == (3, 0), run["errors"]
    assert all(r["finish_reason"] == "eos_token" and r["output_tokens"] < 32 for r in run["requests"]), run["requests"]
    assert live.engine.counters().structured_output.requests >= before + 3  # the probe's request as well
    assert report["config"]["response_format"] == str(tmp_path / "schema.json")
