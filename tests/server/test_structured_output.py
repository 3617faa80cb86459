"""Structured output and tool calls through a live server on the default checkpoint (a small Shakespeare model:
what it writes under a grammar is nonsense, but it must parse and validate), given a ChatML chat template that
renders tools, and speculating with n-gram drafts (requests opt out with speculative: false)."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from server.api.chat_template import render
from server.api.limits import Limits
from tests.server.conftest import serve, sse_events

CHATML = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = 20
PROMPT = "ROMEO: What light through yonder window breaks?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_checkpoint):
    directory = tmp_path_factory.mktemp("chatml-ckpt")
    for f in default_checkpoint.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    live = serve(
        directory, app_kw={"limits": Limits(max_n=SEEDS)}, max_num_seqs=32, max_waiting=64, speculative="ngram"
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def ok(client: httpx.Client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def texts_of(answer: dict) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice of a completions or chat answer."""
    return [(c.get("text", c.get("message", {}).get("content")), c["finish_reason"]) for c in answer["choices"]]


def sampled(client: httpx.Client, path: str, form: dict, max_tokens: int = 48, **extra) -> list[tuple[str, str]]:
    """SEEDS sampled choices (temperature 1, n copies of one seeded request: each its own seed)."""
    body = {"max_tokens": max_tokens, "temperature": 1.0, "n": SEEDS, "seed": 3, **form, **extra}
    body.update(
        {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    return texts_of(ok(client, path, body))


SCHEMA_FORMS = [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
    ),
    ("/v1/completions", {"structured_outputs": {"json": PERSON}}),
    ("/v1/chat/completions", {"guided_json": json.dumps(PERSON)}),
]


@pytest.mark.parametrize("path,form", SCHEMA_FORMS, ids=["response_format", "chat", "structured_outputs", "guided"])
def test_json_schema_outputs_sampled_over_seeds_all_parse_and_validate(client, path, form):
    outs = sampled(client, path, form)
    assert len({text for text, _ in outs}) > 1, "the seeds should sample different objects"
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_outputs_parse_as_objects(client, server):
    # the small model seldom writes a quote or a brace: biased towards '"' and '}' and away from ',', its strings
    # and objects close within the tokens given
    tok = server.engine.tokenizer
    bias = {}
    for t in range(tok.vocab_size):
        text = tok.decode([t])
        if "," in text or '"' in text or "}" in text:
            bias[str(t)] = -8.0 if "," in text else 4.0
    form = {"response_format": {"type": "json_object"}, "logit_bias": bias}
    outs = sampled(client, "/v1/completions", form, 128)
    outs += sampled(
        client,
        "/v1/chat/completions",
        {**form, "response_format": None, "structured_outputs": {"json_object": True}},
        128,
    )
    for text, finish in outs:
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text


GRAMMAR = 'root ::= "SELECT " col " FROM t" where?\nwhere ::= " WHERE " col " = " [0-9]\ncol ::= "a" | "b"'


@pytest.mark.parametrize(
    "form,check",
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,6}"}}, r"[0-9]{3}-[a-z]{2,6}"),
        ({"guided_regex": "(yes|no), [A-Z][a-z]{1,5}"}, r"(yes|no), [A-Z][a-z]{1,5}"),
        ({"structured_outputs": {"choice": ["to be", "not to be"]}}, r"to be|not to be"),
        ({"guided_choice": ["Romeo", "Juliet", "Mercutio"]}, r"Romeo|Juliet|Mercutio"),
        ({"structured_outputs": {"grammar": GRAMMAR}}, r"SELECT (a|b) FROM t( WHERE (a|b) = [0-9])?"),
        ({"guided_grammar": 'start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/'}, r"yes|no|[1-9][0-9]?"),
    ],
    ids=["regex", "guided_regex", "choice", "guided_choice", "ebnf", "lark"],
)
def test_regex_choice_and_grammar_outputs_match(client, form, check):
    outs = sampled(client, "/v1/completions", form, max_tokens=24)
    for text, finish in outs:
        assert finish == "stop" and re.fullmatch(check, text), (text, finish)


@pytest.mark.parametrize(
    "grammar,check",
    [
        ({"type": "json", "value": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
        ({"type": "regex", "value": "[0-9]{2}:[0-9]{2}"}, lambda text: re.fullmatch("[0-9]{2}:[0-9]{2}", text).group()),
    ],
    ids=["json", "regex"],
)
def test_tgi_grammar_sampled_over_seeds(client, grammar, check):
    def generate(seed: int) -> dict:
        parameters = {"max_new_tokens": 48, "do_sample": True, "seed": seed, "grammar": grammar, "details": True}
        return ok(client, "/generate", {"inputs": PROMPT, "parameters": parameters})

    with ThreadPoolExecutor(SEEDS) as pool:
        answers = list(pool.map(generate, range(SEEDS)))
    for answer in answers:
        assert answer["details"]["finish_reason"] == "eos_token", answer
        check(answer["generated_text"])
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 48, "grammar": grammar}}
    with client.stream("POST", "/generate_stream", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    check("".join(e["token"]["text"] for e in events))


def test_a_constrained_request_cut_by_max_tokens_ends_with_length_and_keeps_its_text(client):
    form = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    answer = ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, **form})
    ((text, finish),) = texts_of(answer)
    assert finish == "length" and answer["usage"]["completion_tokens"] == 5
    assert text and ('{"name":"'.startswith(text) or text.startswith('{"name":"')), text


# ---- exactness ------------------------------------------------------------------------------------


def scored(client: httpx.Client, body: dict) -> tuple[str, list[float], dict]:
    answer = ok(client, "/v1/completions", body)
    choice = answer["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"], answer["usage"]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_constrained_logprobs_are_bitwise_equal_cached_uncached_batched_on_a_prefix_hit_and_speculating(
    client, temperature
):
    salt = uuid.uuid4().hex  # a prefix cache of its own: the first request misses, the next ones can hit
    form = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    base = {"prompt": PROMPT * 3, "max_tokens": 40, "temperature": temperature, "seed": 11, "logprobs": 0, **form}
    base |= {"cache_salt": salt, "speculative": False}
    reference = scored(client, base)
    assert reference[2]["prompt_tokens_details"]["cached_tokens"] == 0
    hit = scored(client, base)
    assert hit[2]["prompt_tokens_details"]["cached_tokens"] > 0
    uncached = scored(client, {**base, "use_cache": False})
    speculating = scored(client, {**base, "speculative": True})
    others = [{**base, "seed": s, "temperature": 1.0} for s in range(5)] + [
        {"prompt": PROMPT, "max_tokens": 30, "logprobs": 0}
    ]
    with ThreadPoolExecutor(len(others) + 1) as pool:  # one batch with other constrained and free requests
        batched = list(pool.map(lambda body: scored(client, body), [base, *others]))[0]
    for name, run in [("prefix hit", hit), ("uncached", uncached), ("speculating", speculating), ("batched", batched)]:
        assert run[:2] == reference[:2], name
    jsonschema.validate(json.loads(reference[0]), PERSON)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_speculative_drafts_the_grammar_forbids_are_rejected_and_the_output_is_unchanged(client, temperature):
    # the drafter proposes another " ROMEO:" after the fourth, which the grammar forbids (digits must come)
    regex = "( ROMEO:){4}[0-9]{2}"
    body = {"prompt": "ROMEO: ROMEO: ROMEO: ROMEO:", "max_tokens": 30, "temperature": temperature, "seed": 5}
    body |= {"logprobs": 0, "structured_outputs": {"regex": regex}, "cache_salt": uuid.uuid4().hex}
    plain = scored(client, {**body, "speculative": False})
    drafted = scored(client, {**body, "speculative": True})
    assert drafted[:2] == plain[:2] and re.fullmatch(regex, plain[0]), (plain, drafted)
    details = drafted[2]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0, details


# ---- tool calls -----------------------------------------------------------------------------------


def chat(client: httpx.Client, **body) -> dict:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Verona?"}]
    return ok(client, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 96, **body})


def check_call(call: dict, names=tuple(PARAMETERS)) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_"), call
    assert call["function"]["name"] in names, call
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


@pytest.mark.parametrize(
    "choice,names",
    [("required", tuple(PARAMETERS)), ({"type": "function", "function": {"name": "add"}}, ("add",))],
    ids=["required", "named"],
)
def test_forced_tool_calls_sampled_over_seeds_match_their_parameters(client, choice, names):
    answer = chat(client, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, n=10, seed=2)
    for c in answer["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        (call,) = c["message"]["tool_calls"]
        check_call(call, names)


def test_forced_tool_calls_stream_as_openai_streams_them(client, server):
    from openai import OpenAI

    openai = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, http_client=httpx.Client(trust_env=False))
    messages = [{"role": "user", "content": "Weather in Verona?"}]
    body = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice="required", temperature=1.0, seed=8)
    whole = openai.chat.completions.create(**body, max_tokens=96, parallel_tool_calls=False)
    chunks = list(openai.chat.completions.create(**body, max_tokens=96, parallel_tool_calls=False, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function" and first.function.name
    assert len(rest) > 1 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert (first.function.name, arguments) == (call.function.name, call.function.arguments)
    check_call({"id": first.id, "type": "function", "function": {"name": first.function.name, "arguments": arguments}})


def test_past_calls_and_tool_results_reach_the_template_with_arguments_as_objects(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    tools = TOOLS[1:]
    answer = ok(client, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 4})
    as_objects = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        messages[2],
    ]
    expected = render(CHATML, as_objects, tools=tools)
    assert '{"name": "add", "arguments": {"a": 1, "b": 2}}' in expected and "<tool_response>\n3\n" in expected
    assert answer["usage"]["prompt_tokens"] == len(server.engine.tokenizer.encode(expected))


def test_auto_tool_choice_leaves_the_model_free(client):
    answer = chat(client, temperature=0, max_tokens=12)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["message"]["content"]


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,message",
    [
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {}}}}},
            'response_format.json_schema.schema does not compile: Unimplemented keys: ["not"]',
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 1}}},
            "structured_outputs.json does not compile: Unsatisfiable schema",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "a("}}, "structured_outputs.regex does not compile"),
        ("/v1/chat/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar does not compile"),
        ("/v1/completions", {"guided_json": "{oops"}, "guided_json is not valid JSON"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "one structured output per request: response_format, guided_regex",
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice names the function 'fly', which is not among the tools ('get_weather', 'add')",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters does not compile: Unimplemented keys",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format and a forced tool call",
        ),
        (
            "/generate",
            {"parameters": {"grammar": {"type": "regex", "value": "(("}}},
            "parameters.grammar.value does not compile",
        ),
        ("/generate", {"parameters": {"grammar": {"type": "json", "value": {"enum": []}}}}, "Unsatisfiable"),
        ("/generate", {"parameters": {"grammar": {"type": "regex", "value": {"a": 1}}}}, "a regex grammar's value"),
    ],
)
def test_a_grammar_that_cannot_be_served_is_refused_naming_the_problem(client, path, body, message):
    body = dict(body)
    if path == "/generate":
        body["inputs"] = PROMPT
    elif path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    r = client.post(path, json=body)
    assert r.status_code == (422 if path == "/generate" else 400), r.text
    error = r.json()["error"]
    assert message in (error if isinstance(error, str) else error["message"]), r.text


def test_constrained_requests_and_mask_time_are_counted(client, server):
    before = server.metric("kvserve:structured_output_requests_total")
    seconds = server.metric("kvserve:structured_output_mask_seconds_total")
    ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "guided_choice": ["yes", "no"], "n": 3})
    assert server.metric("kvserve:structured_output_requests_total") == before + 3
    assert server.metric("kvserve:structured_output_mask_seconds_total") > seconds
    assert server.metric("kvserve:structured_output_mask_rows_total") > 0
