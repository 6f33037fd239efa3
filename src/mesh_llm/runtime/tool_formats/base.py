"""What every tool-call format shares: the events a parser emits, and the incremental JSON scanning
that lets a call's arguments stream as the model writes them.

A parser is fed the generated text in pieces (as the detokenizer releases it) and returns events:
content to show, a call starting (its index, id and name), or a fragment of a call's arguments.
Markup (``<tool_call>``, ``[TOOL_CALLS]``, the JSON around the arguments) never reaches content, and
the fragments of one call concatenate to its arguments exactly as the model wrote them.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class Event:
    kind: Literal["content", "call", "arguments"]
    text: str = ""  # content, or a fragment of the arguments
    index: int = 0  # which call (in the order the model made them)
    id: str = ""  # "call" only
    name: str = ""  # "call" only


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]:
        """The generation ended: whatever was held back (an unfinished call still counts)."""
        ...


class PlainText:
    """The parser for a reply without tools: all of it is content."""

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


@dataclass(frozen=True)
class Function:
    """One function tool, as the request gave it."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None

    def openai_json(self) -> dict[str, Any]:
        """The tool as OpenAI's chat API spells it: what chat templates expect in ``tools``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def call_schema(self, arguments_key: str = "arguments") -> dict[str, Any]:
        """A JSON schema for one call of this function: its name, then arguments matching its parameters."""
        return {"type": "object", "properties": {"name": {"const": self.name}, arguments_key: self.parameters},
                "required": ["name", arguments_key]}


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def short_call_id() -> str:
    """Nine letters and digits: Mistral's templates refuse any other tool-call id."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class JsonScanner:
    """Finds where one JSON value ends in text that arrives in pieces (strings and escapes aware)."""

    def __init__(self) -> None:
        self._depth, self._started, self._in_string, self._escape, self._scalar = 0, False, False, False, False
        self.done = False

    def feed(self, text: str) -> tuple[str, str | None]:
        """The part of ``text`` that belongs to the value (leading whitespace dropped), and what
        follows the value once it is complete (None while it is not)."""
        start = 0
        for i, ch in enumerate(text):
            if not self._started:
                if ch.isspace():
                    start = i + 1
                    continue
                self._started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._scalar = True
                continue
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return self._end(text, start, i + 1)
            elif self._scalar:
                if ch in ",}] \t\r\n":
                    return self._end(text, start, i)
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._end(text, start, i + 1)
        return text[start:], None

    def _end(self, text: str, start: int, end: int) -> tuple[str, str]:
        self.done = True
        return text[start:end], text[end:]


_STRING = r'"((?:[^"\\]|\\.)*)"'


class CallStream:
    """One call object, ``{"name": "...", "arguments": {...}, ...}``, parsed as it arrives.

    When the name comes before the arguments (the order every format prompts for, and the order the
    grammars impose), the call starts as soon as its name is known and its arguments stream; in any
    other order the object is read whole and parsed at its end.
    """

    def __init__(self, index: int, new_id, arguments_keys: tuple[str, ...] = ("arguments",)):
        self.index, self._new_id = index, new_id
        keys = "|".join(re.escape(k) for k in arguments_keys)
        self._header = re.compile(r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*' + _STRING
                                  + r'\s*,\s*"(?:' + keys + r')"\s*:\s*', re.S)
        self._keys = arguments_keys
        self._buffer = ""
        self._object = JsonScanner()  # the whole call object, to find its end
        self._arguments: JsonScanner | None = None
        self.started = False
        self.done = False

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        """Events, and the text after the object once it is complete (None while it is not)."""
        _, rest = self._object.feed(text)
        taken = text if rest is None else text[:len(text) - len(rest)]
        events: list[Event] = []
        if self._arguments is None:
            self._buffer += taken
            match = self._header.match(self._buffer)
            if match:
                self.started = True
                self._arguments = JsonScanner()
                events.append(Event("call", index=self.index, id=self._new_id(), name=_unescape(match[1])))
                taken = self._buffer[match.end():]
        if self._arguments is not None and not self._arguments.done:
            part, _ = self._arguments.feed(taken)
            if part:
                events.append(Event("arguments", part, self.index))
        if rest is not None:
            self.done = True
            if not self.started:
                events += self._whole()
        return events, rest

    def finish(self) -> list[Event]:
        """The text ended inside the object: a started call keeps what it has; one not yet started is
        parsed if it can be, else dropped (it was never a call)."""
        return [] if self.started else self._whole()

    def _whole(self) -> list[Event]:
        try:
            value = json.loads(self._buffer)
        except ValueError:
            return []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        arguments = next((value[k] for k in self._keys if k in value), {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self.started = True
        return [Event("call", index=self.index, id=self._new_id(), name=value["name"]),
                Event("arguments", text, self.index)]


def _unescape(text: str) -> str:
    try:
        return json.loads(f'"{text}"')
    except ValueError:
        return text


class MarkerText:
    """Plain text that may contain a marker (``<tool_call>``): releases the text before it, holding
    back any tail that could be the marker's beginning."""

    def __init__(self, marker: str):
        self.marker = marker
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Content safe to show, and the text after the marker once it is seen (None before)."""
        text = self._held + text
        self._held = ""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at], text[at + len(self.marker):]
        keep = next((n for n in range(min(len(self.marker) - 1, len(text)), 0, -1)
                     if self.marker.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class Content:
    """Content events for a parser: whitespace is held until text follows it, so the blank lines
    around and between calls never show as content."""

    def __init__(self) -> None:
        self._space = ""
        self.calls = 0

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        if text.isspace():
            self._space += text
            return []
        text, self._space = self._space + text, ""
        return [Event("content", text)]

    def call_started(self) -> int:
        """Drops held whitespace and returns the new call's index."""
        self._space = ""
        self.calls += 1
        return self.calls - 1

    def finish(self) -> list[Event]:
        space, self._space = self._space, ""
        return [Event("content", space)] if space and not self.calls else []


class CallList:
    """``call, call, ...]``: the calls of a JSON list whose ``[`` was already read, as they arrive."""

    def __init__(self, content: Content, new_id, arguments_keys: tuple[str, ...] = ("arguments",)):
        self._content, self._new_id, self._keys = content, new_id, arguments_keys
        self._call: CallStream | None = None

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        """Events, and the text after ``]`` once the list is closed (None before)."""
        events: list[Event] = []
        while True:
            if self._call is None:
                text = text.lstrip().lstrip(",").lstrip()
                if not text:
                    return events, None
                if text[0] == "]":
                    return events, text[1:]
                self._call = CallStream(self._content.call_started(), self._new_id, self._keys)
            found, text = self._call.feed(text)
            events += found
            if text is None:
                return events, None
            self._call = None

    def finish(self) -> list[Event]:
        return self._call.finish() if self._call is not None else []


class JsonStringStream:
    """The text of one JSON string value (its opening quote already read), decoded as it arrives:
    an escape split across pieces is held until complete."""

    def __init__(self) -> None:
        self._raw = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Decoded text, and what follows the closing quote once it is seen (None before)."""
        raw = self._raw + text
        i, safe = 0, 0
        while i < len(raw):
            ch = raw[i]
            if ch == '"':
                self._raw = ""
                return _decode(raw[:i]), raw[i + 1:]
            if ch != "\\":
                i += 1
                safe = i
                continue
            need = 2
            if raw[i + 1:i + 2] == "u":
                need = 6
                if raw[i + 2:i + 4].lower() in ("d8", "d9", "da", "db"):  # a surrogate pair: 12
                    need = 12
            if i + need > len(raw):
                break
            i += need
            safe = i
        self._raw = raw[safe:]
        return _decode(raw[:safe]), None


def _decode(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
