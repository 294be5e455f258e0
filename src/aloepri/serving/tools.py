"""Tool calling on the client side, for models whose chat template writes calls as Hermes-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 and Qwen2.5-Coder, Hermes, and
others trained on that format).

The server only sees token ids, so everything an engine's tool parser does happens here: the tools are rendered
into the prompt by the plaintext chat template, and the decoded reply is parsed for tool calls, which become
OpenAI ``tool_calls``. A reply that is only a call object naming one of the request's tools, without the tags
(small models trained on the format sometimes leave them out), is a call too. :class:`ToolCallStream` does the same on a streamed reply: it hands out content until a
tool call begins and holds the rest until the reply ends. No torch here.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` as the chat template takes them; ValueError (naming what is wrong) otherwise."""
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        clean = {"name": fn["name"]}
        for k in ("description", "parameters"):
            if fn.get(k) is not None:
                clean[k] = fn[k]
        out.append({"type": "function", "function": clean})
    return out


def template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them: ``arguments`` as an object
    (OpenAI sends a JSON string; templates write it with ``tojson``)."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: 'tool_calls' must be a non-empty list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: tool_calls[{j}] must have function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}: tool_calls[{j}].function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}: tool_calls[{j}].function.arguments must be a JSON object")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            entry["id"] = c["id"]
        out.append(entry)
    return out


def _call(block: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare_calls(text: str, names: set[str] | None) -> list[dict[str, Any]] | None:
    """A reply that is nothing but a call object (or a list of them) naming one of the request's tools, bare or
    in a ```json fence: small models trained on the tagged format sometimes leave the tags out."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1) if fenced else body
    if not body.startswith(("{", "[")) or not names:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    objs = obj if isinstance(obj, list) else [obj]
    if not objs or not all(isinstance(o, dict) and o.get("name") in names and set(o) <= {"name", "arguments",
                                                                                         "parameters"}
                           for o in objs):
        return None
    calls = [_call(json.dumps(o)) for o in objs]
    return None if any(c is None for c in calls) else calls


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content before the calls or None, OpenAI tool_calls) if ``text`` holds tool calls that all parse;
    None otherwise (then the text is the reply's content, as engines' parsers leave it). ``names``: the
    request's tool names; with them, a reply that is only a call object naming one of them counts too."""
    start = text.find(OPEN)
    if start < 0:
        calls = _bare_calls(text, names)
        return None if calls is None else (None, calls)
    calls = [_call(m.group(1)) for m in _BLOCK.finditer(text, start)]
    if not calls or any(c is None for c in calls):
        return None
    content = text[:start].strip()
    return (content or None), calls


class ToolCallStream:
    """A streamed reply's text in, content to hand out now; from ``<tool_call>`` on the text is held, and
    :meth:`finish` parses it. A tail that could still become ``<tool_call>`` is held back too, and so is a reply
    that begins like a bare call object (``{``, ``[`` or a code fence) until it ends."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.names = names
        self._pending = ""
        self._in_call = False
        self._started = False  # some content was handed out

    def push(self, text: str) -> str:
        self._pending += text
        if self._in_call:
            return ""
        head = self._pending.lstrip()
        if not self._started and self.names and (not head or head[0] in "{[`"):
            if head:
                self._in_call = True  # perhaps a bare call: decided at the end
            return ""
        i = self._pending.find(OPEN)
        if i >= 0:
            out, self._pending, self._in_call = self._pending[:i], self._pending[i:], True
            return out
        hold = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                     if self._pending.endswith(OPEN[:k])), 0)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._started = self._started or bool(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]] | None]:
        """(content still held, tool calls or None). Text that is not a well-formed call is content."""
        rest, self._pending = self._pending, ""
        if not self._in_call:
            return rest, None
        parsed = parse_tool_calls(rest, self.names)
        if parsed is None:
            return rest, None
        content, calls = parsed
        return content or "", calls
