"""Tool-call parsers (vLLM's `--tool-call-parser` names): a model's output text -> its content and tool calls.

hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text around them is content
(Qwen2.5, Qwen3, Hermes). llama3_json: Llama 3.1/3.2's JSON calls, `{"name": ..., "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>`; an output that is not all calls is content.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass

from sparseserve.registry import Registry


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolParser(abc.ABC):
    """extract: the whole output's (content or None, calls). stream_hold: where a tool call may begin in a
    streamed output so far (text before it can go out as content)."""

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]: ...

    @abc.abstractmethod
    def stream_hold(self, text: str) -> int: ...


TOOL_PARSERS: Registry[type[ToolParser]] = Registry("tool_call_parser")


def _call(obj: object, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # already JSON text
        try:
            json.loads(args)
        except ValueError:
            return None
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_marker(text: str, marker: str) -> int:
    """The start of the longest end of `text` that begins `marker` (len(text) when none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


@TOOL_PARSERS.register("hermes")
class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.OPEN not in text:
            return text, []
        calls = []
        for body in self.BLOCK.findall(text):
            try:
                call = _call(json.loads(body.strip()), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:  # a block that is no call: the whole output is content
                return text, []
            calls.append(call)
        content = self.BLOCK.sub("", text).strip()
        return content or None, calls

    def stream_hold(self, text: str) -> int:
        at = text.find(self.OPEN)
        return at if at >= 0 else _partial_marker(text, self.OPEN)


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            at = len(body) - len(rest)
        return None, calls

    def stream_hold(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # a call may be coming: hold everything
        return len(text)


def get_tool_parser(name: str) -> ToolParser:
    return TOOL_PARSERS.get(name)()
