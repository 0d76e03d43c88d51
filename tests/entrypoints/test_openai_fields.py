"""The OpenAI fields applications rely on, with the `openai` client against a real `sparseserve serve` process
(the embedded model, CPU, float32): structured outputs (response_format, structured_outputs, guided_*), tool
calls (required and named, streamed and not), logit_bias, penalties against a reference computed in torch on
transformers' model, echo, several prompts in one request, GET /v1/models/{id}, and the invalid combinations
(400 naming the param). The embedded model knows no JSON: the constraints alone make its outputs valid."""

from __future__ import annotations

import functools
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from sparseserve.metrics import parse_metrics
from sparseserve.models.loader import DEFAULT_MODEL_DIR
from sparseserve.sampling_params import SamplingParams
from tests.server_utils import server_process

pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow  # a server process

MODEL = "tiny"
FLAGS = (
    "--served-model-name",
    MODEL,
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "32",
    "--seed",
    "0",
)


@pytest.fixture(scope="module")
def server():
    with server_process(*FLAGS) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-3 required properties: enums, bounded integers and strings, booleans, short arrays,
    nested objects (bounded everywhere: the embedded model would otherwise write one string until max_tokens)."""

    def value(d: int) -> dict:
        kinds = ["enum", "int", "bool", "str", "array"] + (["object"] if d < 2 else [])
        kind = rng.choice(kinds)
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", 1, 2, 3], rng.randint(1, 4))}
        if kind == "int":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "str":
            return {"type": "string", "maxLength": rng.randint(1, 6)}
        if kind == "array":
            return {"type": "array", "items": value(2), "maxItems": rng.randint(1, 2)}
        return random_schema(rng, d + 1)

    names = rng.sample(["id", "name", "kind", "size", "tags", "meta", "ok", "city", "unit"], rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: value(depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def test_json_schema_outputs_validate_for_random_schemas(client):
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(20)]
    prompts = [f"Describe item number {i} of the catalogue." for i in range(20)]

    def ask(i: int) -> str:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        if i % 2:  # completions take response_format too (vLLM's)
            r = client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=200, temperature=0, extra_body={"response_format": fmt}
            )
            return r.choices[0].text, r.choices[0].finish_reason
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=200,
            temperature=0,
            response_format=fmt,
        )
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(20) as pool:  # one batch: 20 constrained requests side by side
        outs = list(pool.map(ask, range(20)))
    for schema, (text, finish) in zip(schemas, outs):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_and_regex_are_honoured(client):
    # The embedded model never closes a free-form string: a bias towards '"' and '}' lets json_object end.
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        logit_bias={"4": 15, "95": 15},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    choices = ["alpha", "beta gamma", "delta"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick"}],
        max_tokens=20,
        temperature=1.0,
        seed=3,
        n=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt="The code is",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"},
    )
    for c in r.choices:
        assert len(c.text) == 6 and c.text[:2].isupper() and c.text[2] == "-" and c.text[3:].isdigit(), c.text


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["a", "b"],
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """The tool calls of a streamed response, assembled from their deltas by index; its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choices_return_valid_calls(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
        # one call (the embedded model would add calls to the array until max_tokens)
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=120,
            temperature=0,
            stream=stream,
            parallel_tool_calls=False,
        )
        if stream:
            calls, finish = streamed_calls(r)
        else:
            message = r.choices[0].message
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
            ]
            finish = r.choices[0].finish_reason
        assert calls, tool_choice
        for call in calls:
            assert call["id"] and call["name"] in SCHEMAS
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if tool_choice == "required":
            assert finish == "tool_calls"
        else:
            assert [c["name"] for c in calls] == ["add"] and finish == "stop"


def test_a_template_without_tool_rendering_gets_the_tools_in_a_system_message(client):
    """The embedded model's chat template ignores `tools`: they reach the prompt through a system message."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    auto = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, tools=TOOLS)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert auto.choices[0].message.content is not None and not auto.choices[0].message.tool_calls


def test_logit_bias_of_100_makes_greedy_output_that_token(client, tokenizer):
    token = 1234
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logit_bias={str(token): 100}
    )
    assert r.choices[0].text == tokenizer.decode([token] * 6)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): 100},
        logprobs=True,
    )
    assert r.choices[0].message.content == tokenizer.decode([token] * 4)


@pytest.fixture(scope="module")
def reference_greedy():
    """Greedy decoding on transformers' model with the penalties as defined: repetition divides a positive logit
    (multiplies a negative one) of every token of the prompt or the output; frequency and presence subtract
    count * frequency and presence once per output token seen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()

    @functools.cache
    def greedy(
        prompt_ids: tuple[int, ...],
        num_tokens: int,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
    ) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(num_tokens):
                logits = model(torch.tensor([list(prompt_ids) + out])).logits[0, -1].float()
                vocab = logits.shape[0]
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
                seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(prompt_ids))
                logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
                logits = logits - frequency * counts - presence * (counts > 0).float()
                out.append(int(logits.argmax()))
        return out

    return greedy


@pytest.mark.parametrize(
    "fields",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=1.5),
        dict(repetition_penalty=1.8),
        dict(presence_penalty=-0.5, frequency_penalty=0.6, repetition_penalty=1.2),
    ],
)
def test_penalties_match_a_torch_reference(client, tokenizer, reference_greedy, fields):
    prompt = "the cat and the dog and the cat and the dog and the cat"
    ids = tuple(tokenizer.encode(prompt))
    extra = {"ignore_eos": True, "repetition_penalty": fields.get("repetition_penalty", 1.0)}
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        presence_penalty=fields.get("presence_penalty", 0.0),
        frequency_penalty=fields.get("frequency_penalty", 0.0),
        extra_body=extra,
    )
    expected = reference_greedy(
        ids,
        16,
        fields.get("presence_penalty", 0.0),
        fields.get("frequency_penalty", 0.0),
        fields.get("repetition_penalty", 1.0),
    )
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert expected != reference_greedy(ids, 16)  # the penalty changed the output


def test_echo_returns_the_prompt(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ids = tokenizer.encode(prompt)
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == prompt and len(only.choices[0].logprobs.tokens) == len(ids)
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + plain.choices[0].text


def test_a_list_of_prompts_returns_choices_indexed_by_prompt(client, tokenizer):
    prompts = ["The quick brown fox", "Once upon a time"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text for p in prompts
    ]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == alone
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    r = client.completions.create(
        model=MODEL, prompt=[tokenizer.encode(p) for p in prompts], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]  # OpenAI's: prompt * n + i
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 10
    assert texts == {0: alone[0], 1: alone[1]}


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
CMPL = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
TOOL = TOOLS[:1]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", dict(CMPL, best_of=2), "best_of"),
        ("completions", dict(CMPL, suffix="!"), "suffix"),
        ("completions", dict(CMPL, prompt=[]), "prompt"),
        ("completions", dict(CMPL, stream_options={"include_usage": True}), "stream_options"),
        ("chat/completions", dict(CHAT, top_logprobs=2), "top_logprobs"),
        ("chat/completions", dict(CHAT, stream_options={"include_usage": True}), "stream_options"),
        ("chat/completions", dict(CHAT, presence_penalty=3), "presence_penalty"),
        ("chat/completions", dict(CHAT, logit_bias={"99999999": 1}), "logit_bias"),
        ("chat/completions", dict(CHAT, logit_bias={"x": 1}), "logit_bias"),
        ("chat/completions", dict(CHAT, repetition_penalty=0), "repetition_penalty"),
        ("chat/completions", dict(CHAT, min_tokens=10), "min_tokens"),
        ("chat/completions", dict(CHAT, tool_choice="required"), "tool_choice"),
        (
            "chat/completions",
            dict(CHAT, tools=TOOL, tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
        ),
        (
            "chat/completions",
            dict(CHAT, tools=TOOL, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
        ("chat/completions", dict(CHAT, tools=TOOL + TOOL), "tools"),
        (
            "chat/completions",
            dict(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema",
        ),
        ("chat/completions", dict(CHAT, response_format={"type": "json_object"}, guided_regex="a+"), "guided_regex"),
        ("chat/completions", dict(CHAT, guided_regex="a("), "guided_regex"),
        ("completions", dict(CMPL, structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        ("completions", dict(CMPL, structured_outputs={"grammar": "start: undefined_rule"}), "structured_outputs"),
        (
            "chat/completions",
            dict(
                CHAT,
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    },
                },
            ),
            "response_format",
        ),
    ],
)
def test_invalid_combinations_are_400_naming_the_param(server, path, body, param):
    r = httpx.post(f"{server}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_no_block_leaks_and_the_server_keeps_serving(server, client):
    r = client.completions.create(model=MODEL, prompt="Still here", max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 20  # the engine publishes its stats after each step
    while parse_metrics(httpx.get(f"{server}/metrics").text)["sparseserve:kv_cache_blocks_used"] != 0:
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.05)


def test_sampling_params_from_a_request_keep_the_fields():
    from sparseserve.entrypoints.protocol import CompletionRequest

    req = CompletionRequest(
        prompt="x",
        logit_bias={"5": 3},
        repetition_penalty=1.1,
        min_tokens=2,
        max_tokens=8,
        structured_outputs={"json": {"type": "object"}},
    )
    p = req.sampling_params(8, None)
    assert isinstance(p, SamplingParams) and p.logit_bias == {5: 3.0} and p.repetition_penalty == 1.1
    assert p.min_tokens == 2 and p.structured_outputs.json == {"type": "object"}
