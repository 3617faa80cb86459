"""Structured output at the door: each request form becomes one GrammarSpec (model/grammar.py), compiled here
so that a schema or grammar that does not compile is refused before the engine sees it, naming the field and
the reason (422, which OpenAI's routes answer as 400). The compile is cached: the engine's own look-up for
the same spec is a cache hit.

The forms: OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` (json, regex,
choice, grammar, json_object) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
TGI's `parameters.grammar` (json, regex), and a forced tool call (server/api/tool_calls.py).
"""

from __future__ import annotations

import asyncio
import json

from model.grammar import GrammarCompiler, GrammarError, GrammarSpec
from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.protocol import TGIGrammar
from server.api.protocol_openai import JsonObjectFormat, JsonSchemaResponseFormat, SamplingFields

MAX_REASON = 2000  # characters of a compiler's message kept in a refusal


def _schema(value: dict | str, field: str) -> GrammarSpec:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _refused(field, f"is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise _refused(field, "is not a JSON schema (an object)")
    return GrammarSpec.json_schema(value)


def openai_grammar(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The grammar a completions or chat request asks for, and the field that asked; None: free text."""
    found: list[tuple[GrammarSpec, str]] = []
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        found.append((GrammarSpec("json_object"), "response_format"))
    elif isinstance(fmt, JsonSchemaResponseFormat):
        field = "response_format.json_schema.schema"
        found.append((_schema(fmt.json_schema.json_schema, field), field))
    so = body.structured_outputs
    if so is not None:
        if so.json_schema is not None:
            found.append((_schema(so.json_schema, "structured_outputs.json"), "structured_outputs.json"))
        elif so.regex is not None:
            found.append((GrammarSpec("regex", so.regex), "structured_outputs.regex"))
        elif so.choice is not None:
            found.append((GrammarSpec.choice(so.choice), "structured_outputs.choice"))
        elif so.grammar is not None:
            found.append((GrammarSpec("grammar", so.grammar), "structured_outputs.grammar"))
        else:
            found.append((GrammarSpec("json_object"), "structured_outputs.json_object"))
    if body.guided_json is not None:
        found.append((_schema(body.guided_json, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        found.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append((GrammarSpec.choice(body.guided_choice), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((GrammarSpec("grammar", body.guided_grammar), "guided_grammar"))
    if len(found) > 1:
        raise APIError(
            422,
            f"one structured output per request: {', '.join(field for _, field in found)} ask for several",
            "validation",
            reason="grammar",
        )
    return found[0] if found else None


def tgi_grammar(grammar: TGIGrammar | None) -> tuple[GrammarSpec, str] | None:
    """TGI's parameters.grammar as a GrammarSpec, and its field; None: free text."""
    if grammar is None:
        return None
    field = "parameters.grammar.value"
    if grammar.type == "regex":
        return GrammarSpec("regex", grammar.value), field
    return _schema(grammar.value, field), field


async def checked(engine: EngineClient, found: tuple[GrammarSpec, str] | None) -> GrammarSpec | None:
    """The grammar a request asks for (`openai_grammar`'s or `tgi_grammar`'s answer), once it compiles."""
    return None if found is None else await check_grammar(engine, *found)


async def check_grammar(engine: EngineClient, spec: GrammarSpec, field: str) -> GrammarSpec:
    """`spec` compiled for the engine's tokenizer (cached), off the event loop (a large schema may take a while);
    a grammar that does not compile is refused naming `field` and the compiler's reason."""
    compiler = GrammarCompiler.shared(engine.tokenizer, engine.model_config.vocab_size)
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as e:
        raise _refused(field, f"does not compile: {e}") from e
    return spec


def _refused(field: str, reason: str) -> APIError:
    reason = reason.strip()
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON] + "..."
    return APIError(422, f"{field} {reason}", "validation", reason="grammar")
