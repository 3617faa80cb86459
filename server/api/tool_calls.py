"""Tool calls in /v1/chat/completions: the grammar that forces a call (tool_choice 'required' or a named
function), the tools and past calls as a chat template reads them, and the calls parsed out of the generated
text, whole or streamed.

A forced call is generated in the Hermes form, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(several separated by newlines when parallel calls are allowed), its arguments held to the function's
parameters schema. With tool_choice 'auto' the model writes what its chat template taught it: calls are read
in the Hermes form anywhere in the text, and in Llama 3's JSON form, an answer that is one object
`{"name": ..., "parameters": {...}}` (or a list of them).

One parser reads both a whole answer and a stream (`ToolCallParser`): text goes out as content until a call
opens; a call whose name comes first streams its name, then its arguments' JSON text piece by piece as it is
generated; any other call is sent whole once it closes. A call cut short (max_tokens) keeps what was sent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from model.grammar import JSON_OPTIONS, GrammarSpec
from server.api.protocol_openai import MessageToolCall, NamedToolChoice, Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's marker before a call
NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
NO_ARGUMENTS = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the forced call ------------------------------------------------------------------------------


def _call_schema(tool: Tool) -> dict:
    """The JSON of one call of `tool`: its name, then its arguments (its parameters schema, whose $defs move to
    the root so that their references still resolve)."""
    params = dict(tool.function.parameters or NO_ARGUMENTS)
    hoisted = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
        **hoisted,
    }


def parameters_spec(tool: Tool) -> GrammarSpec:
    """One function's parameters as a JSON-schema grammar (to check it on its own, naming the tool)."""
    return GrammarSpec.json_schema(tool.function.parameters or NO_ARGUMENTS)


def tool_grammar(tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> GrammarSpec | None:
    """The grammar a tool_choice forces: a call of the named function, or (required) of any of the tools, one
    or (parallel) several; None for auto and none, which leave the model free."""
    if isinstance(choice, NamedToolChoice):
        tools, parallel = [t for t in tools if t.function.name == choice.function.name], False
    elif choice != "required":
        return None
    bodies = "\n".join(f"body_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(tools))
    alternatives = " | ".join(f"body_{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f'call: "{CALL_OPEN}\\n" ({alternatives}) "\\n{CALL_CLOSE}"'
    return GrammarSpec("lark", f"{start}\n{call}\n{bodies}\n")


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as transformers hands them to a chat template (OpenAI's form, as dicts)."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


def template_tool_calls(calls: list[MessageToolCall]) -> list[dict]:
    """An assistant message's calls as chat templates read them: arguments as an object where the JSON text
    is one (templates write `arguments | tojson`), as vLLM and transformers pass them."""
    out = []
    for call in calls:
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # left as the text it is
        out.append({"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}})
    return out


# ---- parsing --------------------------------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of one call: its first (id, name) or a fragment of its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class _Arguments:
    """Finds where one JSON value ends in text that arrives piece by piece."""

    depth: int = 0
    started: bool = False
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def take(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return self._end(i + 1)
            elif self.depth == 0 and ch in ",\n ":  # a bare number, true, false or null ended
                return self._end(i)
        return len(text)

    def _end(self, n: int) -> int:
        self.done = True
        return n


@dataclass
class ToolCallParser:
    """One choice's text as content and tool calls. `push` takes each new piece of text and returns the
    content and call pieces it completes; `finish` returns the rest. `max_calls`: 1 without parallel calls
    (later ones are dropped)."""

    max_calls: int | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet given out
    _mode: str = "start"  # start, content, call (in a call, before its arguments), arguments, closing, json
    _arguments: _Arguments | None = None

    @property
    def found_calls(self) -> bool:
        return bool(self.calls)

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[CallDelta]]:
        content, deltas = [], []
        while True:
            progressed = getattr(self, f"_in_{self._mode}")(content, deltas, final)
            if not progressed:
                break
        return "".join(content), deltas

    # each mode's step: True when it changed mode (the next one runs on what is left)

    def _in_start(self, content, deltas, final) -> bool:
        stripped = self._buffer.lstrip()
        if not final and PYTHON_TAG.startswith(stripped):  # nothing yet, or what may become the tag
            return False
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG) :].lstrip()
        if stripped.startswith(("{", "[")):  # Llama 3's JSON form, or content that starts like it: decided at the end
            self._buffer, self._mode = stripped, "json"
        else:
            self._mode = "content"
        return True

    def _in_content(self, content, deltas, final) -> bool:
        at = self._buffer.find(CALL_OPEN)
        if at >= 0:
            self._emit_content(content, self._buffer[:at])
            self._buffer, self._mode = self._buffer[at + len(CALL_OPEN) :], "call"
            return True
        keep = 0 if final else _partial_suffix(self._buffer, CALL_OPEN)
        self._emit_content(content, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _emit_content(self, content: list, text: str) -> None:
        if self.calls and not text.strip():  # the newlines around calls are not content
            return
        content.append(text)

    def _in_call(self, content, deltas, final) -> bool:
        match = NAME_FIRST.match(self._buffer)
        if match:  # the name first: stream it now, then the arguments as they come
            self._open_call(deltas, json.loads(f'"{match.group(1)}"'))
            self._buffer, self._mode, self._arguments = self._buffer[match.end() :], "arguments", _Arguments()
            return True
        close = self._buffer.find(CALL_CLOSE)
        if close < 0 and not final:
            return False
        # any other order: the whole call once it is there (or the text as it was, if it is not a call)
        end = close + len(CALL_CLOSE) if close >= 0 else len(self._buffer)
        body, original, self._buffer = (
            self._buffer[: close if close >= 0 else end],
            self._buffer[:end],
            self._buffer[end:],
        )
        self._whole_call(content, deltas, body, CALL_OPEN + original)
        self._mode = "content"
        return close >= 0

    def _in_arguments(self, content, deltas, final) -> bool:
        if not self._arguments.started:
            self._buffer = self._buffer.lstrip()
        n = self._arguments.take(self._buffer)
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        if piece:
            self._append_arguments(deltas, piece)
        if self._arguments.done:
            self._mode = "closing"
            return True
        return False

    def _in_closing(self, content, deltas, final) -> bool:
        close = self._buffer.find(CALL_CLOSE)
        if close >= 0:
            self._buffer, self._mode = self._buffer[close + len(CALL_CLOSE) :], "content"
            return True
        if final:
            self._buffer = ""
        return False

    def _in_json(self, content, deltas, final) -> bool:
        if not final:
            return False
        text, self._buffer = self._buffer, ""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        objects = value if isinstance(value, list) else [value]
        if objects and all(_is_call(v) for v in objects):
            for v in objects:
                self._add_call(deltas, v["name"], _arguments_text(v))
        else:
            content.append(text)
        self._mode = "content"
        return False

    # calls

    def _open_call(self, deltas: list, name: str) -> None:
        self.calls.append(ParsedCall(new_call_id(), name, ""))
        if not self._dropped:
            deltas.append(CallDelta(len(self.calls) - 1, id=self.calls[-1].id, name=name, arguments=""))

    @property
    def _dropped(self) -> bool:
        return self.max_calls is not None and len(self.calls) > self.max_calls

    def _append_arguments(self, deltas: list, piece: str) -> None:
        self.calls[-1].arguments += piece
        if not self._dropped:
            deltas.append(CallDelta(len(self.calls) - 1, arguments=piece))

    def _add_call(self, deltas: list, name: str, arguments: str) -> None:
        self._open_call(deltas, name)
        self._append_arguments(deltas, arguments)

    def _whole_call(self, content: list, deltas: list, body: str, original: str) -> None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            value = None
        if _is_call(value):
            self._add_call(deltas, value["name"], _arguments_text(value))
        else:  # not a call after all: the text as it was
            content.append(original)

    def result(self) -> list[ParsedCall]:
        """The calls kept (the first max_calls)."""
        return self.calls if self.max_calls is None else self.calls[: self.max_calls]


def _is_call(value) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get("arguments", value.get("parameters", {})), dict | str)
    )


def _arguments_text(call: dict) -> str:
    arguments = call.get("arguments", call.get("parameters", {}))
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer's content (None when it is calls only) and its calls."""
    parser = ToolCallParser(max_calls)
    content, _ = parser.push(text)
    rest, _ = parser.finish()
    content += rest
    calls = parser.result()
    return (content if content.strip() or not calls else None), calls
