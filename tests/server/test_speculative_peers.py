"""`python -m bench.speculative_peers`: the client that times one server's completions of repetitive
prompts, against a stub server that records what it was sent."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.speculative_peers import MAX_TOKENS, PASSAGE, main, prompt_for


@pytest.fixture
def stub_server():
    """A /v1/completions that answers every request with 7 tokens of the same text, and keeps the bodies."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            answer = json.dumps({"choices": [{"text": "ROMEO: again"}], "usage": {"completion_tokens": 7}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


def test_a_run_times_every_request_but_the_warm_up_and_appends_one_line(stub_server, tmp_path):
    url, bodies = stub_server
    out = tmp_path / "runs.jsonl"
    for label in ("ours-plain", "ours-ngram-k4"):
        assert main([url, "tiny", label, "--requests", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["ours-plain", "ours-ngram-k4"]
    assert [len(r["tok_s"]) for r in rows] == [3, 3], "the warm-up is not timed"
    assert all(r["tokens"] == 7 and r["same_text_every_run"] and r["text_heads"] is None for r in rows)
    assert len(bodies) == 8, "one warm-up and three measured requests a run"
    assert {b["prompt"] for b in bodies} == {PASSAGE * 3}
    assert all(b["max_tokens"] == MAX_TOKENS and b["temperature"] == 0 and b["ignore_eos"] for b in bodies)


def test_with_a_play_every_request_repeats_a_passage_of_its_own(stub_server, tmp_path):
    url, bodies = stub_server
    play = tmp_path / "play.txt"
    play.write_text("\n".join(f"line {i}" for i in range(4000)))
    out = tmp_path / "runs.jsonl"
    assert main([url, "tiny", "distinct", "--requests", "2", "--play", str(play), "--out", str(out)]) == 0
    prompts = [b["prompt"] for b in bodies]
    assert len(set(prompts)) == 3, "the warm-up and both measured requests differ"
    assert prompts[1] == ("\n".join(f"line {i}" for i in range(2300, 2306)) + "\n\n") * 3
    assert prompts == [prompt_for(i, play.read_text().splitlines()) for i in range(3)]
    row = json.loads(out.read_text())
    assert row["distinct_passages"] and len(row["text_heads"]) == 2
