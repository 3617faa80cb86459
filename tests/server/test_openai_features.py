"""What real clients send, through the official clients against a live server: n and best_of, lists
of prompts and token ids, logprobs with top alternatives, echo and scoring, penalties, logit_bias,
usage, chat completions with a chat template (and 400 without one), and TGI's prefill details,
top tokens and best_of through huggingface_hub."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from model.generate import sequence_cache
from model.kv_cache import StepBatch
from tests.conftest import EXACT
from tests.server.conftest import serve

PROMPT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def client(live):
    from openai import OpenAI

    return OpenAI(
        base_url=live.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


@pytest.fixture(scope="module")
def hf_client(live):
    from huggingface_hub import InferenceClient

    return InferenceClient(base_url=live.url, timeout=60)


def greedy_text(client, prompt, n=8):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text


def test_n_with_a_seed_gives_n_different_samples_and_the_same_n_again(client, live):
    def four():
        out = client.completions.create(prompt=PROMPT, max_tokens=12, n=4, temperature=1.0, seed=11, model="tiny")
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.text for c in out.choices]

    first = four()
    assert len(set(first)) == 4
    assert four() == first
    streamed = client.completions.create(
        prompt=PROMPT, max_tokens=12, n=4, temperature=1.0, seed=11, model="tiny", stream=True
    )
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == first


def test_the_copies_of_n_share_the_prompts_blocks(live):
    prompt = "Whether 'tis nobler in the mind to suffer " * 3
    before = live.metric("kvserve:prefix_cache_hits_total")
    body = {"prompt": prompt, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 2, "cache_salt": "copies"}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    hits = live.metric("kvserve:prefix_cache_hits_total") - before
    prompt_tokens = r["usage"]["prompt_tokens"]
    assert hits == 2 * ((prompt_tokens - 1) // 16 * 16) > 0, (
        "copies 2 and 3 should read the prompt from copy 1's blocks"
    )


def test_best_of_returns_the_likeliest_of_its_samples(client):
    out = client.completions.create(
        prompt=PROMPT, max_tokens=8, n=2, best_of=5, temperature=1.0, seed=3, logprobs=0, model="tiny"
    )
    assert len(out.choices) == 2
    # usage counts the returned choices' tokens, not the three samples left out (as vLLM counts them)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    totals = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert totals == sorted(totals, reverse=True)
    every = client.completions.create(
        prompt=PROMPT, max_tokens=8, n=5, temperature=1.0, seed=3, logprobs=0, model="tiny"
    )
    best_two = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)[:2]
    assert totals == pytest.approx(best_two, abs=0)


def test_a_batch_of_prompts_gives_what_each_prompt_gives_alone(client, live):
    prompts = ["To be", "Whether 'tis", "世界"]
    alone = [greedy_text(client, p) for p in prompts]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == alone and [c.index for c in out.choices] == [0, 1, 2]
    ids = [live.engine.tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == alone
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=8, temperature=0)
    assert one.choices[0].text == alone[0]
    assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    counted = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, logprobs=0)
    assert counted.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in counted.choices)


def test_logprobs_give_the_top_alternatives_of_each_token(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6), "greedy: the chosen token is the likeliest"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    # as OpenAI gives it, the chosen token is in top_logprobs too, also where it is not among the likeliest
    sampled = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=2.0, seed=3, logprobs=1)
        .choices[0]
        .logprobs
    )
    # (keys are each id's own text: where two ids both decode to a part of one character, '\ufffd', the likelier stays)
    for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs):
        assert chosen_in_top(token, logprob, top) and 1 <= len(top) <= 2, (token, logprob, top)
    assert any(len(top) == 2 for top in sampled.top_logprobs), "temperature 2 never sampled past the likeliest"


def test_logprobs_name_each_token_by_its_own_text_and_a_stream_carries_one_per_token(client, live):
    """A stop string that could begin at a token's last character holds that token's text back, and the
    next's: the logprobs still name every token by its own text (as vLLM does), streamed or not, one entry
    per generated token."""
    details = httpx.post(
        live.url + "/generate",
        timeout=60,
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}},
    ).json()["details"]["tokens"]
    own = [live.engine.tokenizer.decode([t["id"]]) for t in details]
    i = next(
        i for i in range(len(own) - 2) if own[i].strip() and own[i + 1].strip() and "\ufffd" not in own[i] + own[i + 1]
    )
    stop = own[i][-1] + own[i + 1] + "\u2603 never"  # a prefix of it at tokens i and i + 1; never matched
    base = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, stop=[stop])
    plain = client.completions.create(**base).choices[0].logprobs
    assert plain.tokens == own
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(**base, stream=True)
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert len(streamed) < len(own), "no token's text was held back: the test proves nothing"
    assert [t for lp in streamed for t in lp.tokens] == own
    assert [x for lp in streamed for x in lp.token_logprobs] == plain.token_logprobs


def chosen_in_top(token: str, logprob: float, top: dict[str, float]) -> bool:
    """The chosen token's logprob is among `top`'s (keyed by each id's own text), or, for a token that is
    part of one character (its text in `tokens` held back, or holding '\ufffd'), the key '\ufffd' that it
    shares with another such id, which keeps the likelier of them."""
    if logprob in top.values():
        return True
    return (token == "" or "\ufffd" in token) and top.get("\ufffd", float("-inf")) >= logprob


def direct_prompt_logprobs(model, ids):
    cache, blocks = sequence_cache(model, len(ids))
    hidden = model.forward_step(StepBatch.build([(ids, 0, blocks)], cache.block_size, model.device), cache)
    logits = model.compute_logits(hidden)
    lp = logits - logits.logsumexp(-1, keepdim=True)  # (T, V)
    return [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_direct_forward_and_as_decoder_input_details(client, live):
    ids = live.engine.tokenizer.encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0
    scored = choice.logprobs.token_logprobs
    assert len(scored) == len(ids) and scored[0] is None and choice.logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(choice.logprobs.tokens[1:], scored[1:], choice.logprobs.top_logprobs[1:]):
        # the prompt's own token, and the likeliest 2
        assert chosen_in_top(token, logprob, top) and 1 <= len(top) <= 3, (token, logprob, top)
    direct = direct_prompt_logprobs(live.engine.model, ids)
    for got, want in zip(scored[1:], direct[1:]):
        assert got == want if EXACT else abs(got - want) <= 1e-4
    tgi = httpx.post(
        live.url + "/generate",
        timeout=60,
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "decoder_input_details": True}},
    ).json()["details"]["prefill"]
    assert [t["id"] for t in tgi] == ids and [t["logprob"] for t in tgi] == scored
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0)
    assert echoed.choices[0].text.startswith(PROMPT)
    assert echoed.choices[0].logprobs.token_logprobs[: len(ids)] == scored
    assert len(echoed.choices[0].logprobs.tokens) == len(ids) + 3


def test_prompt_logprobs_are_within_1e_4_of_transformers(default_checkpoint, default_tokenizer):
    transformers = pytest.importorskip("transformers")
    text = "HAMLET:\nTo be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    ids = default_tokenizer.encode(text)
    hf = transformers.GPT2LMHeadModel.from_pretrained(default_checkpoint).eval()
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    server = serve(default_checkpoint, max_num_seqs=2)
    try:
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0},
        ).json()
    finally:
        server.stop()
    scored = r["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(scored[i] - reference[i - 1, ids[i]].item()) for i in range(1, len(ids))) <= 1e-4


def test_penalties_and_logit_bias(client, live):
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"42": 100})
    assert live.engine.tokenizer.encode(forced.choices[0].text) == [42] * 4 or forced.choices[
        0
    ].text == live.engine.tokenizer.decode([42] * 4)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=0)
    penalised = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        logprobs=0,
        presence_penalty=1.5,
        frequency_penalty=1.5,
    )
    assert penalised.choices[0].text != plain.choices[0].text
    assert len(set(penalised.choices[0].logprobs.tokens)) >= len(set(plain.choices[0].logprobs.tokens))


def test_stream_include_usage_and_an_optional_model(live):
    body = {
        "prompt": "To be",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert lines[-1]["choices"] == [] and lines[-1]["usage"]["completion_tokens"] == 5
    assert lines[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert all(line["model"] == "tiny" for line in lines)


def test_chat_completions_answers_400_without_a_chat_template(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="has no chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_openais_sdk_sees_a_context_overflow_as_openai_reports_one(client):
    """Clients trim a conversation on BadRequestError with code context_length_exceeded (LangChain, LiteLLM)."""
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as overflow:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1000)
    assert overflow.value.status_code == 400 and overflow.value.code == "context_length_exceeded"
    assert overflow.value.type == "invalid_request_error" and "maximum context length" in overflow.value.message
    with pytest.raises(BadRequestError) as out_of_range:  # any other bad field: the same class, its own code
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=3)
    assert out_of_range.value.code == "validation" and "temperature" in out_of_range.value.message


TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_live(tmp_path_factory, tiny_checkpoint):
    import shutil

    directory = tmp_path_factory.mktemp("chat-ckpt")
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, directory / f.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    server = serve(directory, max_num_seqs=4)
    yield server
    server.stop()


def test_chat_completions_through_a_chat_template(chat_live):
    from openai import OpenAI

    client = OpenAI(
        base_url=chat_live.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )
    messages = [{"role": "system", "content": "Speak as Hamlet."}, {"role": "user", "content": "To be?"}]
    rendered = "<system>Speak as Hamlet.\n<user>To be?\n<assistant>"
    reference = client.completions.create(model="tiny", prompt=rendered, max_tokens=8, temperature=0)
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == reference.choices[0].text
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in out.choices[0].logprobs.content)
    streamed = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_tgi_top_n_tokens_decoder_input_details_and_best_of_through_inference_client(hf_client, live):
    out = hf_client.text_generation(PROMPT, max_new_tokens=5, details=True, decoder_input_details=True, top_n_tokens=3)
    ids = live.engine.tokenizer.encode(PROMPT)
    assert [t.id for t in out.details.prefill] == ids and out.details.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in out.details.prefill[1:])
    assert len(out.details.top_tokens) == 5 and all(len(top) == 3 for top in out.details.top_tokens)
    first = [top[0]["id"] if isinstance(top[0], dict) else top[0].id for top in out.details.top_tokens]
    assert first == [t.id for t in out.details.tokens]  # greedy: the likeliest is the one chosen
    best = hf_client.text_generation(PROMPT, max_new_tokens=6, details=True, best_of=3, do_sample=True, seed=4)
    assert len(best.details.best_of_sequences) == 2
    mine = sum(t.logprob for t in best.details.tokens)
    assert all(sum(t.logprob for t in s.tokens) <= mine for s in best.details.best_of_sequences)
    streamed = list(hf_client.text_generation(PROMPT, max_new_tokens=3, stream=True, details=True, top_n_tokens=2))
    assert all(len(e.top_tokens) == 2 for e in streamed)
