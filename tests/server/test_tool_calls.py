"""Tool calls read out of generated text (server/api/tool_calls.py): the Hermes form and Llama 3's JSON form,
whole or streamed piece by piece, with the same result; and the grammar that forces a call."""

from __future__ import annotations

import json

import pytest

from server.api.protocol_openai import NamedToolChoice, Tool
from server.api.tool_calls import CALL_CLOSE, CALL_OPEN, ToolCallParser, parse_tool_calls, tool_grammar


def streamed(text: str, max_calls: int | None = None, piece: int = 1) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) of each call, from the text pushed `piece` characters at a time; each
    call's first delta must carry its id and name, later ones only argument fragments."""
    parser, content, calls = ToolCallParser(max_calls), "", {}
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for out, deltas in [parser.push(p) for p in pieces] + [parser.finish()]:
        content += out
        for d in deltas:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, d
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            calls[d.index][1] += d.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


CASES = [
    (  # content, then two Hermes calls: name first (streamed), then arguments first (sent whole)
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": [1, {"a": "}"}]}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", '{"city": "Paris", "x": [1, {"a": "}"}]}'), ("add", '{"a": 1}')],
    ),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "now", "parameters": {}}', None, [("now", "{}")]),
    ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 2}}]', None, [("a", "{}"), ("b", '{"k": 2}')]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ("a <tool_ca that never opens", "a <tool_ca that never opens", []),
    (f"{CALL_OPEN}not json{CALL_CLOSE} after", f"{CALL_OPEN}not json{CALL_CLOSE} after", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_calls_parse_the_same_whole_and_streamed(text, content, calls):
    whole_content, whole = parse_tool_calls(text)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole] == calls
    for piece in (1, 3, len(text)):
        stream_content, stream_calls = streamed(text, piece=piece)
        assert stream_content == (content or ""), piece
        assert stream_calls == calls, piece


def test_without_parallel_calls_only_the_first_is_kept():
    call = '\n{"name": "%s", "arguments": {}}\n'
    text = f"{CALL_OPEN}{call % 'a'}{CALL_CLOSE}\n{CALL_OPEN}{call % 'b'}"
    assert [c.name for c in parse_tool_calls(text, max_calls=1)[1]] == ["a"]
    assert streamed(text, max_calls=1)[1] == [("a", "{}")]


def test_a_call_cut_short_keeps_its_name_and_the_arguments_generated():
    content, calls = parse_tool_calls(f'{CALL_OPEN}\n{{"name": "f", "arguments": {{"a": 1')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1')]


def test_the_forced_grammar_names_the_chosen_function_only():
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        Tool.model_validate({"type": "function", "function": {"name": "g"}}),
    ]
    named = tool_grammar(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "g"}}), True)
    assert '"const": "g"' in named.value and '"const": "f"' not in named.value and "call)*" not in named.value
    required = tool_grammar(tools, "required", True)
    assert '"const": "f"' in required.value and '"const": "g"' in required.value and "call)*" in required.value
    assert tool_grammar(tools, "auto", True) is None and tool_grammar(tools, "none", True) is None
    assert json.loads(named.value.split("%json ", 1)[1].splitlines()[0])["properties"]["arguments"] == {
        "type": "object",
        "properties": {},
    }
