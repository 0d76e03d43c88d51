"""Tool calling in chat completions: what `tools` and `tool_choice` do to the prompt, the output's constraint
and the response.

- auto (the default with tools): the chat template renders the tools; the output is parsed (tool_parsers.py)
  into content and tool calls.
- required: the output is constrained to a JSON array of calls ({"name", "parameters"} per tool's schema).
- a named function: the output is constrained to that function's arguments (its `parameters` schema).
- none: the tools are rendered, the output is content.
A chat template that does not render tools (the embedded model's) gets them in a system message instead,
with the JSON format the llama3_json parser reads (`fallback_messages`).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any

from sparseserve.entrypoints.tool_parsers import ParsedCall, ToolParser, get_tool_parser
from sparseserve.sampling_params import ParameterError, StructuredOutputsParams

PROBE_NAME = "sparseserve_probe_tool_7f3a"  # a name no template writes unless it renders the tools


@dataclass
class ToolPlan:
    choice: str  # none, auto, required or named
    tools: list[dict[str, Any]]  # OpenAI's tool objects
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto: reads the output
    constraint: StructuredOutputsParams | None = None  # required / named: the output's JSON schema
    template_tools: bool = True  # the chat template renders them (else a system message does)

    @property
    def calls_expected(self) -> bool:
        return self.choice in ("auto", "required", "named")


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool, parser_name: str
) -> ToolPlan | None:
    """The request's plan, None without tools; ParameterError (param tools / tool_choice) for what is invalid."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ParameterError("tool_choice needs tools", "tool_choice")
        return None
    specs = [t.model_dump(exclude_none=True) for t in tools]
    names = [t["function"]["name"] for t in specs]
    if len(set(names)) != len(names):
        raise ParameterError("tools must have distinct function names", "tools")
    for t in specs:
        params = t["function"].get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise ParameterError(f"the parameters of tool {t['function']['name']!r} must be an object schema", "tools")
    if tool_choice is None or isinstance(tool_choice, str):
        choice = tool_choice or "auto"
        plan = ToolPlan(choice, specs)
        if choice == "auto":
            plan.parser = get_tool_parser(parser_name)
        elif choice == "required":
            plan.constraint = StructuredOutputsParams(json=calls_schema(specs, parallel_tool_calls))
        return plan
    name = tool_choice.function.name
    if name not in names:
        raise ParameterError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    params = next(t["function"].get("parameters") for t in specs if t["function"]["name"] == name)
    return ToolPlan("named", specs, name=name, constraint=StructuredOutputsParams(json=params or {"type": "object"}))


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each {"name": one tool's name, "parameters": its arguments}."""
    calls = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "parameters"],
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as chat templates read them: earlier calls' arguments as objects (the templates of the
    tool-calling families serialize them themselves)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _as_object(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parser_name(configured: str, tokenizer: Any) -> str:
    """The server's --tool-call-parser; auto: hermes when the chat template writes <tool_call>, else
    llama3_json (Llama 3.1/3.2, and the format `fallback_messages` asks for)."""
    if configured != "auto":
        return configured
    template = getattr(tokenizer, "chat_template", None) or ""
    return "hermes" if "<tool_call>" in str(template) else "llama3_json"


_RENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given into the prompt (probed once)."""
    known = _RENDERS.get(tokenizer)
    if known is None:
        probe = [
            {
                "type": "function",
                "function": {
                    "name": PROBE_NAME,
                    "description": "probe",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=probe, tokenize=False, add_generation_prompt=True
            )
            known = PROBE_NAME in text
        except Exception:  # a template that fails with tools does not render them
            known = False
        _RENDERS[tokenizer] = known
    return known


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools in a system message (for a template that does not render them): before the first message, or
    added to the system message that opens the conversation."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = (
        "You can call these functions (JSON schemas of their parameters):\n"
        + listing
        + '\nTo call one, answer only with JSON: {"name": function name, "parameters": its arguments}.'
    )
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first] + messages[1:]
    return [{"role": "system", "content": text}] + messages


# ---- the output's calls ---------------------------------------------------------------------------------------


def output_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A finished output's (content, calls) under the plan."""
    if plan.choice == "named":
        return None, [ParsedCall(plan.name, text)]
    if plan.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (max_tokens): no calls to report
            return text, []
        return None, [ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
    if plan.choice == "auto":
        return plan.parser.extract(text)
    return text, []


@dataclass
class ToolStream:
    """One choice's streamed output under a plan: text deltas in, (content delta, tool-call deltas) out.
    A named call's arguments stream as they come; auto and required hold back from where calls may begin
    and send the calls whole when the choice finishes."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of text sent as content (or named arguments)
    opened: bool = False  # named: the call's opening delta went out
    num_calls: int = 0
    call_ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, finished: bool, new_id: Any) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        plan = self.plan
        if plan.choice == "named":
            calls = []
            if not self.opened:
                self.opened = True
                self.num_calls = 1
                calls.append(
                    {"index": 0, "id": new_id(), "type": "function", "function": {"name": plan.name, "arguments": ""}}
                )
            if delta:
                calls.append({"index": 0, "function": {"arguments": delta}})
            return "", calls
        if plan.choice not in ("auto", "required"):
            return delta, []
        if not finished:
            hold = 0 if plan.choice == "required" else plan.parser.stream_hold(self.text)
            out, self.sent = self.text[self.sent : max(hold, self.sent)], max(hold, self.sent)
            return out, []
        _, calls = output_calls(plan, self.text)
        rest = "" if calls else self.text[self.sent :]  # (text after a call is not streamed)
        self.num_calls = len(calls)
        return rest, [
            {"index": i, "id": new_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
