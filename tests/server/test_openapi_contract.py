"""The OpenAPI schema describes what the server does: bounded and strict fields, every error
status with its shape, the content types of streams and metrics; then a bounded schemathesis run with
every check, whose only failures are the known ones a schema cannot express."""

from __future__ import annotations

import re

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the schemathesis package is not installed")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS, load_all_checks  # noqa: E402
from schemathesis.core.failures import Failure, FailureGroup  # noqa: E402

EXAMPLES_PER_OPERATION = 60
# a stream that stays open until the server stops (KV_STREAM_MAX_S): a case would wait out its timeout;
# its events are checked against the schema in test_kv_view.py
ENDLESS_STREAMS = {"/kv/stream"}
GENERATION_ROUTES = ["/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions"]

# Schema-valid requests the server refuses for reasons no static schema can state: they depend on the
# checkpoint (its vocabulary, context, chat template) or on the server's flags. (message pattern, why)
KNOWN_REFUSALS = [
    (r"out of range \[0, \d+\)|is not a token id in \[0, \d+\)", "a token id at or above the vocabulary size"),
    (
        r"the context holds \d+|exceeds the context of \d+|KV-cache blocks",
        "the prompt and max tokens pass the context (or the KV cache)",
    ),
    (
        r"\(--max-[a-z-]+( \+ --max-[a-z-]+)?\)",
        "a limit set by a server flag (--max-n, --max-logprobs, --max-prompts, ...)",
    ),
    (
        r"seed: Input should be less than or equal to 9223372036854775807",
        "a seed a few units past 2**63 - 1, which the generator takes as within the bound (a float64 rounds both "
        "to 2**63); the server compares integers exactly",
    ),
    (r"has no chat template|the chat template failed", "the checkpoint's chat template (none, or it raised)"),
    (r"content parts of type", "a chat content part that is not text (a 400 naming it, by design)"),
    (
        r"best_of > 1 needs sampling|best_of .* must be at least n|cannot be streamed|max_tokens 0 needs echo|"
        r"continuous_usage_stats needs|only allowed with stream: true|top_logprobs needs logprobs|"
        r"needs tools|which is not among the tools|two functions have the same name|takes exactly one of|"
        r"one structured output per request|cannot both constrain the output|a regex grammar's value",
        "a rule between two fields",
    ),
    (
        r"does not compile: |is not valid JSON: |is not a JSON schema",
        "a JSON schema, regex or grammar that does not compile (refused naming the field and the reason)",
    ),
]


def test_the_schema_declares_streams_metrics_and_error_statuses(live):
    spec = httpx.get(live.url + "/openapi.json", timeout=30).json()
    for path in GENERATION_ROUTES:
        responses = spec["paths"][path]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"], path
        statuses = (
            ("400", "401", "413", "429", "503", "504")
            if path.startswith("/v1/")
            else ("400", "401", "413", "422", "429", "503", "504")
        )  # OpenAI's routes answer 400 where TGI's answer 422
        assert path.startswith("/v1/") != ("422" in responses), path
        for status in statuses:
            schema = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert schema.endswith("OpenAIErrorResponse" if path.startswith("/v1/") else "/ErrorResponse"), (
                path,
                status,
            )
    assert list(spec["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]) == ["text/event-stream"]
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [httpx.get(live.url + "/metrics", timeout=30).headers["content-type"]]
    assert list(metrics)[0].startswith("text/plain")
    generate = spec["components"]["schemas"]["GenerateParameters"]["properties"]
    assert {"type": "number", "minimum": 1.0} in generate["timeout"]["anyOf"]


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", {"inputs": "x", "parameters": {"timeout": 5e-324}}, "parameters.timeout"),
        ("/v1/completions", {"prompt": "x", "timeout": 0.5}, "timeout"),
        ("/generate", {"inputs": "x", "stream": 0}, "stream"),
        ("/v1/completions", {"prompt": "x", "stream": 0}, "stream"),
        ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
        ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2.5}}, "parameters.max_new_tokens"),
    ],
)
def test_a_value_outside_its_declared_type_or_bound_is_refused(live, path, body, field):
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == (400 if path.startswith("/v1/") else 422), r.text
    error = r.json()["error"]
    assert (error["message"] if isinstance(error, dict) else error).startswith(field), r.text


def test_a_whole_number_is_an_integer_as_json_schema_counts_it(live):
    r = httpx.post(
        live.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2.0, "details": True}}, timeout=60
    )
    assert r.status_code == 200 and r.json()["details"]["generated_tokens"] <= 2, r.text


def known_refusal(response: httpx.Response) -> str | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    message = error["message"] if isinstance(error, dict) else error
    return next((why for pattern, why in KNOWN_REFUSALS if re.search(pattern, message)), None)


def test_schemathesis_with_every_check_finds_only_the_known_exceptions(live):
    load_all_checks()
    checks = [c for c in CHECKS.get_all() if not isinstance(c, type)]
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    unexpected: list[str] = []
    known: dict[str, int] = {}
    ran: dict[str, int] = {}

    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in ENDLESS_STREAMS:
            continue
        ran[f"{operation.method.upper()} {operation.path}"] = 0
        strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE) | operation.as_strategy(
            generation_mode=GenerationMode.NEGATIVE
        )

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case):
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = "tiny"  # else nearly every case stops at the name's 404 (a name of the
                # wrong type stays: a negative case's invalid part)
            response = case.call(base_url=live.url, timeout=60)
            ran[f"{case.method.upper()} {operation.path}"] += 1  # noqa: B023 (run() is called in this iteration)
            try:
                case.validate_response(response, checks=checks)
            except (Failure, FailureGroup) as e:
                for failure in e.exceptions if isinstance(e, FailureGroup) else [e]:
                    why = known_refusal(response) if failure.title == "Schema-valid request rejected" else None
                    if why is None and response.status_code == 504 and "deadline" in response.text:
                        why = "the request's own timeout passed (a 504, documented)"
                    if why is None:
                        unexpected.append(
                            f"{case.method} {case.path} body={case.body!r} -> {response.status_code} "
                            f"{response.text[:300]}\n{failure}"
                        )
                    else:
                        known[why] = known.get(why, 0) + 1

        run()
    assert ran and all(ran.values()), f"operations no case reached: {[op for op, n in ran.items() if not n]}"
    assert not unexpected, "\n\n".join(unexpected[:5]) + f"\n\n({len(unexpected)} unexpected; known: {known})"
