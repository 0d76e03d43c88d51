"""Tool calling: the output parsers (Hermes' <tool_call> blocks, Llama 3.1/3.2's JSON), the streamed form, the
tool plan (required / named constraints, invalid choices), a template that does not render tools, and tool_choice
auto end to end on an in-process server (the output forced into a call's text by a regex constraint)."""

from __future__ import annotations

import json

import openai
import pytest

from sparseserve.engine.async_engine import AsyncLLMEngine
from sparseserve.engine.engine import LLMEngine
from sparseserve.entrypoints.api_server import ServerConfig, build_app
from sparseserve.entrypoints.protocol import ChatCompletionRequest
from sparseserve.entrypoints.tool_parsers import HermesParser, Llama3JsonParser, ParsedCall
from sparseserve.entrypoints.tools import (
    ToolStream,
    calls_schema,
    fallback_messages,
    message_dicts,
    parser_name,
    plan_tools,
    template_renders_tools,
)
from sparseserve.models.loader import DEFAULT_MODEL_DIR, load_tokenizer
from sparseserve.sampling_params import ParameterError
from tests.server_utils import serve_in_thread

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ECHO = {
    "type": "function",
    "function": {"name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}},
}
# A Hermes-style template (as Qwen2.5's writes tools): tools listed in a system block, calls in <tool_call> tags.
HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Answer with "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


def test_hermes_parser():
    p = HermesParser()
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
    )
    content, calls = p.extract(text)
    assert content == "Sure." and calls == [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("echo", '{"text": "hi"}')]
    assert p.extract("no calls here") == ("no calls here", [])
    assert p.extract('<tool_call>{"name": broken</tool_call>')[1] == []  # not a call: all content
    assert p.extract('<tool_call>{"name": "add", "arguments": {}}')[1] == [ParsedCall("add", "{}")]  # unclosed at EOS
    assert p.stream_hold("Hello <tool") == len("Hello ") and p.stream_hold("Hello") == 5
    assert p.stream_hold("a <tool_call>{") == 2


def test_llama3_json_parser():
    p = Llama3JsonParser()
    assert p.extract('{"name": "add", "parameters": {"a": 1, "b": 2}}') == (
        None,
        [ParsedCall("add", '{"a": 1, "b": 2}')],
    )
    content, calls = p.extract(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "echo", "arguments": {"text": "x"}}'
    )
    assert content is None and [c.name for c in calls] == ["add", "echo"]
    assert p.extract("The answer is 3.") == ("The answer is 3.", [])
    assert p.extract('{"name": "add", "parameters": {"a": 1}} and more text')[1] == []
    assert p.extract('{"not": "a call"}')[1] == []
    assert p.stream_hold("  {") == 0 and p.stream_hold("") == 0 and p.stream_hold("Hi") == 2


def test_streamed_calls_equal_the_whole_outputs():
    auto = plan_tools(make_tools(ADD), "auto", True, "hermes")
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call>'
    stream, content, calls = ToolStream(auto), "", []
    for i in range(0, len(text), 3):
        c, d = stream.feed(text[i : i + 3], i + 3 >= len(text), lambda: "call-1")
        content, calls = content + c, calls + d
    assert content == "Let me add." and calls == [
        {"index": 0, "id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}}
    ]
    named = plan_tools(make_tools(ADD, ECHO), request_choice("echo"), True, "hermes")
    stream, args = ToolStream(named), ""
    deltas = [stream.feed(piece, False, lambda: "call-2")[1] for piece in ['{"text"', ': "hi', '"}']]
    assert deltas[0][0] == {
        "index": 0,
        "id": "call-2",
        "type": "function",
        "function": {"name": "echo", "arguments": ""},
    }
    args = "".join(d["function"]["arguments"] for ds in deltas for d in ds)
    assert json.loads(args) == {"text": "hi"}


def make_tools(*tools):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=list(tools)).tools


def request_choice(name):
    return ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tool_choice={"type": "function", "function": {"name": name}}
    ).tool_choice


def test_tool_plans_and_their_constraints():
    tools = make_tools(ADD, ECHO)
    required = plan_tools(tools, "required", True, "hermes")
    assert required.constraint.json == calls_schema(required.tools, True) and "maxItems" not in required.constraint.json
    assert calls_schema(required.tools, False)["maxItems"] == 1
    named = plan_tools(tools, request_choice("add"), True, "hermes")
    assert named.constraint.json == ADD["function"]["parameters"] and named.name == "add"
    assert plan_tools(tools, "none", True, "hermes").constraint is None
    assert plan_tools(None, None, True, "hermes") is None
    for bad, param in [
        ((None, "required"), "tool_choice"),
        ((tools, request_choice("nope")), "tool_choice"),
        ((make_tools(ADD, ADD), "auto"), "tools"),
    ]:
        with pytest.raises(ParameterError) as e:
            plan_tools(*bad, True, "hermes")
        assert e.value.param == param


def test_templates_with_and_without_tool_rendering():
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    assert not template_renders_tools(tok) and parser_name("auto", tok) == "llama3_json"
    tok.chat_template = HERMES_TEMPLATE
    assert template_renders_tools(load_tokenizer(DEFAULT_MODEL_DIR)) is False  # (per tokenizer object)
    hermes = load_tokenizer(DEFAULT_MODEL_DIR)
    hermes.chat_template = HERMES_TEMPLATE
    assert template_renders_tools(hermes) and parser_name("auto", hermes) == "hermes"
    messages = fallback_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], [ADD])
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.") and '"add"' in messages[0]["content"]
    assert fallback_messages([{"role": "user", "content": "Hi"}], [ADD])[0]["role"] == "system"


def test_earlier_calls_reach_the_template_as_objects():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "add 1 and 2"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
                ],
            },
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
        ]
    )
    messages = message_dicts(req.messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert messages[2]["tool_call_id"] == "c1" and messages[1]["content"] == ""


@pytest.fixture(scope="module")
def hermes_server():
    engine = LLMEngine.from_kwargs(device="cpu", seed=0, max_model_len=512, num_gpu_blocks_override=128)
    engine.tokenizer.chat_template = HERMES_TEMPLATE  # this engine's tokenizer: the template of Qwen's format
    app = build_app(AsyncLLMEngine(engine), ServerConfig(served_model_names=("tiny",)))
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


CALL_REGEX = r'Adding\.<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(hermes_server, stream):
    pytest.importorskip("llguidance")
    r = hermes_server.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Add two numbers."}],
        tools=[ADD],
        max_tokens=60,
        temperature=0,
        stream=stream,
        extra_body={"guided_regex": CALL_REGEX},
    )
    if stream:
        content, calls, finish = "", [], None
        for chunk in r:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        content, name, arguments = (
            message.content,
            message.tool_calls[0].function.name,
            message.tool_calls[0].function.arguments,
        )
    assert content == "Adding." and name == "add" and finish == "tool_calls"
    assert set(json.loads(arguments)) == {"a", "b"}
