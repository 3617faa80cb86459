"""`python -m bench.soak`, small: mixed requests under a KV budget that forces preemptions, a third of
them dropped by the client at random points (before their first event included). No greedy output may
differ from its solo run, and no block may stay held."""

from __future__ import annotations

from bench.soak import plan, soak, start_server
from loadtest.prompts import build_prompts
from model.checkpoint import load_tokenizer
from tests.conftest import TEST_DEVICE, TINY_TEXT

KV_BYTES = 12 * 8192  # 12 blocks of 16 tokens for the tiny model (2 layers x 2 x 32 x 16 x 4 bytes each)


def test_a_short_soak_gives_no_wrong_greedy_output_and_holds_no_block(tiny_checkpoint, tmp_path):
    tokenizer = load_tokenizer(tiny_checkpoint)
    prompts = build_prompts([TINY_TEXT], 4, 12, tokenizer) + build_prompts([TINY_TEXT], 4, 40, tokenizer, seed=1)
    prefix = build_prompts([TINY_TEXT], 1, 15, tokenizer, seed=2)[0] + "\n"
    requests = plan(60, prompts, prefix, drop_share=0.3, greedy_share=0.7, max_new_tokens=48, seed=0)
    url, process = start_server(
        str(tiny_checkpoint),
        ["--kv-cache-memory", str(KV_BYTES), "--max-num-seqs", "8", "--threads", "1", "--device", TEST_DEVICE],
        tmp_path / "server.log",
    )
    try:
        report = soak(url, process.pid, requests, concurrency=8, duration_s=600)
    finally:
        process.terminate()
        process.wait(30)
    assert report.requests == 60 and report.failed == 0, report.failures
    assert report.dropped > 0 and report.dropped_before_first_event > 0 and report.greedy_checked > 0, report
    assert report.preemptions > 0, f"the KV budget should force preemptions: {report}"
    assert report.wrong_greedy_outputs == 0, report.failures
    assert report.blocks_held_after == 0, report
    assert report.rss_after_mib > 0
