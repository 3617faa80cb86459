"""The Llama and Qwen3 families served end to end by the real app, each checked against transformers on a tiny
random checkpoint made here (tests/model/family_checkpoints.py): the prompt's tokens (a BOS for Llama, none for
Qwen3), greedy tokens, logprobs, the model's own chat template, EOS ids from both config files, special tokens
kept out of the text, streaming, prefix caching, speculative decoding, the KV view and attention weights."""

from __future__ import annotations

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.model.family_checkpoints import family_checkpoint  # noqa: E402
from tests.server.conftest import serve, sse_events  # noqa: E402

PROMPT = "To be, or not to be, that is the question"
GREEDY = 20
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Whether 'tis nobler?"}]


class Family:
    """One family's checkpoint, its server, and transformers' model and tokenizer of the same files."""

    def __init__(self, name: str, directory) -> None:
        self.name, self.directory = name, directory
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        self.server = serve(directory)
        self.http = self.server.client()

    def greedy(self, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
        """transformers' greedy continuation of `ids` (n tokens, or up to its generation_config's EOS ids)."""
        with torch.inference_mode():
            out = self.hf.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=1 if stop_at_eos else n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """transformers' log-probabilities at every position of `ids`: (T, V)."""
        with torch.inference_mode():
            return self.hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory):
    f = Family(request.param, family_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    yield f
    f.http.close()
    f.server.stop()


def generate(http: httpx.Client, inputs: str, **parameters) -> dict:
    r = http.post("/generate", json={"inputs": inputs, "parameters": {"details": True, **parameters}})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_prompt_is_tokenized_as_transformers_does(family):
    """A BOS before the Llama prompt (its tokenizer.json adds one), none before Qwen3's; /tokenize and the
    prompt a generation read agree."""
    theirs = family.hf_tokenizer(PROMPT)["input_ids"]
    assert (theirs[0] == family.hf_tokenizer.bos_token_id) == (family.name == "llama")
    r = family.http.post("/tokenize", json={"prompt": PROMPT})
    assert r.json()["tokens"] == theirs
    out = generate(family.http, PROMPT, max_new_tokens=1, decoder_input_details=True)
    assert [t["id"] for t in out["details"]["prefill"]] == theirs
    bare = family.http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == family.hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def test_greedy_tokens_match_transformers(family):
    ids = family.hf_tokenizer(PROMPT)["input_ids"]
    out = generate(family.http, PROMPT, max_new_tokens=GREEDY, ignore_eos=True)
    assert [t["id"] for t in out["details"]["tokens"]] == family.greedy(ids, GREEDY)


def test_streamed_tokens_and_text_are_the_whole_answers_without_special_tokens(family):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": GREEDY, "ignore_eos": True, "details": True}}
    with family.http.stream("POST", "/generate_stream", json=body) as r:
        events = sse_events(r.iter_lines())
    ids = [e["token"]["id"] for e in events]
    whole = generate(family.http, PROMPT, max_new_tokens=GREEDY, ignore_eos=True)
    assert ids == [t["id"] for t in whole["details"]["tokens"]]
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert events[-1]["generated_text"] == whole["generated_text"] == text
    assert whole["generated_text"] == family.hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_uses_the_models_template_and_ends_at_its_eos_ids(family):
    """The messages rendered as transformers renders them (its bos_token for Llama), and the answer is
    transformers' greedy one, ended at the first id of config.json's or generation_config.json's EOS."""
    theirs = family.hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    r = family.http.post("/tokenize", json={"messages": MESSAGES})
    assert r.json()["tokens"] == theirs
    r = family.http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    expected = family.greedy(theirs, 24, stop_at_eos=True)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == family.hf_tokenizer.decode(expected, skip_special_tokens=True)
    eos = set(family.hf.generation_config.eos_token_id)
    assert choice["finish_reason"] == ("stop" if expected[-1] in eos else "length")
    assert r.json()["usage"]["prompt_tokens"] == len(theirs)


def test_tokenizer_info_names_the_checkpoints_special_tokens_and_template(family):
    info = family.http.get("/tokenizer_info").json()
    assert info["bos_token"] == family.hf_tokenizer.bos_token
    assert info["eos_token"] == family.hf_tokenizer.eos_token
    assert info["chat_template"] == family.hf_tokenizer.chat_template
    assert info["model_max_length"] == family.hf.config.max_position_embeddings
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_completion_logprobs_and_echo_match_transformers(family):
    r = family.http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt = family.hf_tokenizer(PROMPT)["input_ids"]
    ids = prompt + family.greedy(prompt, 4)
    expected = family.logprobs(ids)  # (T, V)
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    want = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want), atol=1e-4, rtol=0)
    assert choice["text"].startswith(PROMPT)


def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_tokens(family):
    long_prompt = " ".join([PROMPT] * 4)
    first = generate(family.http, long_prompt, max_new_tokens=8, ignore_eos=True)
    again = generate(family.http, long_prompt, max_new_tokens=8, ignore_eos=True)
    assert again["details"]["cached_tokens"] >= 16
    assert [t["id"] for t in again["details"]["tokens"]] == [t["id"] for t in first["details"]["tokens"]]


def test_attention_rows_are_transformers_weights_per_query_head(family):
    out = generate(family.http, PROMPT, max_new_tokens=3, ignore_eos=True, return_attention=True)
    attention = out["details"]["attention"]
    config = family.hf.config
    assert (attention["layers"], attention["heads"]) == (config.num_hidden_layers, config.num_attention_heads)
    ids = family.hf_tokenizer(PROMPT)["input_ids"] + [t["id"] for t in out["details"]["tokens"]]
    eager = transformers.AutoModelForCausalLM.from_pretrained(family.directory, attn_implementation="eager").eval()
    with torch.inference_mode():
        theirs = torch.stack(eager(torch.tensor([ids]), output_attentions=True).attentions)[:, 0]  # (L, nh, T, T)
    rows = theirs[:, :, attention["query_start"] :]  # the generated tokens' rows (L, nh, Q, T)
    torch.testing.assert_close(torch.tensor(attention["weights"]), rows, atol=1e-4, rtol=0)


def test_the_kv_view_answers(family):
    r = family.http.get("/kv")
    assert r.status_code == 200, r.text
    assert r.json()["num_blocks"] > 0


def test_speculative_decoding_gives_the_same_tokens(family):
    """--speculative ngram drafts by lookup (the second request from what the first generated, the history the
    requests share) and verifies the drafts: the tokens are plain decoding's."""
    server = serve(family.directory, speculative="ngram")
    repeated = " ".join([PROMPT] * 3)
    try:
        with server.client() as http:
            outs = [generate(http, repeated, max_new_tokens=GREEDY, ignore_eos=True) for _ in range(2)]
    finally:
        server.stop()
    plain = generate(family.http, repeated, max_new_tokens=GREEDY, ignore_eos=True, speculative=False)
    assert outs[1]["details"]["accepted_draft_tokens"] > 0, "no draft was accepted: the test proves nothing"
    for out in outs:
        assert [t["id"] for t in out["details"]["tokens"]] == [t["id"] for t in plain["details"]["tokens"]]


def test_preempted_requests_end_with_transformers_greedy_tokens(family):
    """Four requests that need 20 blocks at the end share 10: the newest are preempted, recompute their keys
    and values when they resume, and still end with transformers' greedy tokens."""
    from model.checkpoint import load_model, load_tokenizer
    from model.sampling import SamplingParams
    from server.engine import Engine, EngineConfig

    tokenizer = load_tokenizer(family.directory)
    config = EngineConfig(threads=1, num_blocks=10, block_size=16, max_model_len=128)  # 8 blocks hold a context
    engine = Engine(load_model(family.directory), tokenizer, config)
    words = PROMPT.split()
    prompts = [tokenizer.encode(" ".join(words[i:] + words[:i]), add_special_tokens=True)[:16] for i in range(4)]
    sinks = [[] for _ in prompts]
    for ids, sink in zip(prompts, sinks):
        engine.submit(ids, SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True), sink.append)
    while not all(s and s[-1].finished for s in sinks):
        engine.step()
    assert engine.stats.preemptions > 0, "the cache was large enough: nothing was preempted"
    assert [[e.token_id for e in s] for s in sinks] == [family.greedy(ids, 60) for ids in prompts]


def test_model_generate_gives_transformers_greedy_tokens(family):
    from model.checkpoint import load_model, load_tokenizer
    from model.generate import generate as generate_locally
    from model.sampling import SamplingParams

    steps = generate_locally(
        load_model(family.directory),
        load_tokenizer(family.directory),
        PROMPT,
        SamplingParams(max_new_tokens=GREEDY, temperature=0, ignore_eos=True),
    )
    assert [s.token_id for s in steps] == family.greedy(family.hf_tokenizer(PROMPT)["input_ids"], GREEDY)


def test_the_load_tester_runs_against_a_family_server(family):
    import asyncio

    from loadtest.client import LoadTestConfig, run_load_test
    from loadtest.prompts import load_prompts

    prompts, note = load_prompts(3, 12, None, str(family.directory))
    assert note["tokens_max"] == 12 + (family.name == "llama")  # the BOS the server puts before each
    config = LoadTestConfig(
        url=family.server.url, concurrency=(2,), num_requests=3, max_new_tokens=4, request_timeout_s=60, timeout_s=120
    )
    (run,) = asyncio.run(run_load_test(config, prompts))["runs"]
    assert (run["requests_ok"], run["requests_failed"]) == (3, 0), run["errors"]
    assert [r["server_generated_tokens"] for r in run["requests"]] == [4, 4, 4]
