"""Structured outputs, penalties, min_tokens and prompt logprobs through the engine (the embedded model, CPU):
every constraint kind honoured, a mixed batch of constrained and free requests, async scheduling's
placeholders (the grammar advanced to the previous step's token before the next mask), prompt logprobs
consistent with the sampled tokens' logprobs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.sampling_params import ParameterError, StructuredOutputsParams

pytest.importorskip("llguidance")

KW = dict(device="cpu", seed=0, max_model_len=1024, dtype="float32")
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "pet"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "required": ["kind"],
            "additionalProperties": False,
            "properties": {"kind": {"enum": ["cat", "dog"]}},
        },
    },
}


@pytest.fixture(scope="module")
def llm():
    return LLM(**KW)


def constrained(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(**kw))


def texts(llm, prompts, params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


LARK = 'start: "x=" NUM (";" " y=" NUM)?\nNUM: /[1-9][0-9]?/'
GBNF = 'root ::= "ok" | "no " digit\ndigit ::= [0-9]'
# (kind, its fields, a check of the output); one batch: every kind beside the others
KINDS = [
    ("json", dict(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) or "  " not in t),
    # allowed whitespace is bounded between tokens (this model takes all it may), so the output still ends
    (
        "json ws",
        dict(
            json={
                "type": "object",
                "properties": {"k": {"enum": [1, 2]}},
                "required": ["k"],
                "additionalProperties": False,
            },
            disable_any_whitespace=False,
        ),
        lambda t: json.loads(t)["k"] in (1, 2) and "  " in t,
    ),
    ("regex", dict(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
    ("choice", dict(choice=["red", "green", "blue or purple"]), lambda t: t in ("red", "green", "blue or purple")),
    ("lark", dict(grammar=LARK), lambda t: re.fullmatch(r"x=[1-9][0-9]?(; y=[1-9][0-9]?)?", t)),
    ("gbnf", dict(grammar=GBNF), lambda t: re.fullmatch(r"ok|no [0-9]", t)),
]


def test_every_constraint_kind_is_honoured(llm):
    prompts = ["Tell me about", "Once upon a time"]
    params = [constrained(**kw) for _, kw, _ in KINDS for _ in prompts]
    # The embedded model never closes a free-form string: a bias towards '"' and '}' lets json_object end.
    params += [
        SamplingParams(
            temperature=0.0,
            max_tokens=60,
            logit_bias={4: 15.0, 95: 15.0},
            structured_outputs=StructuredOutputsParams(json_object=True),
        )
    ] * 2
    outs = llm.generate(prompts * (len(KINDS) + 1), params, use_tqdm=False)
    for i, (name, _, check) in enumerate(KINDS):
        for o in outs[2 * i : 2 * i + 2]:
            assert o.outputs[0].finish_reason == "stop" and check(o.outputs[0].text), (name, o.outputs[0].text)
    for o in outs[-2:]:
        assert isinstance(json.loads(o.outputs[0].text), dict)


def test_a_mixed_batch_leaves_free_requests_unchanged(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Alpha beta gamma", "The cat sat", "In the beginning"]
    alone = texts(llm, prompts, free)
    mixed = llm.generate(
        prompts + ["Json please", "Pick"],
        [free, free, free, constrained(json=SCHEMA), constrained(choice=["yes", "no"])],
        use_tqdm=False,
    )
    assert [o.outputs[0].text for o in mixed[:3]] == alone
    jsonschema.validate(json.loads(mixed[3].outputs[0].text), SCHEMA)
    assert mixed[4].outputs[0].text in ("yes", "no") and mixed[4].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_async_scheduling_gives_the_same_outputs():
    """Under async scheduling a sequence's last token is a placeholder while the next step is prepared: the
    grammar (and the penalties) must see the real token first."""
    prompts = ["Json please", "Alpha beta", "Pick one", "Count to ten", "Hello"]
    params = [
        constrained(json=SCHEMA),
        SamplingParams(
            temperature=0.0, max_tokens=20, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5
        ),
        constrained(choice=["left", "right", "middle ground"]),
        constrained(regex=r"(one|two|three)( \d)+"),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15, logit_bias={7: 3.0}),
    ]
    outs = {}
    for mode in (False, True):
        engine = LLM(**KW, async_scheduling=mode)
        outs[mode] = [
            (o.outputs[0].text, o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False)
        ]
    assert outs[True] == outs[False]
    jsonschema.validate(json.loads(outs[True][0][0]), SCHEMA)
    assert len(outs[True][4][1]) >= 15


def test_min_tokens_holds_stop_strings_and_eos_back(llm):
    base = SamplingParams(temperature=0.0, max_tokens=40, stop=[" "])
    early = llm.generate(["The cat sat on the mat and"], base, use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) < 8  # the stop string ends it early
    held = llm.generate(
        ["The cat sat on the mat and"],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" "], min_tokens=8),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= 8


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(llm):
    prompt = [0, 682, 280, 331, 3718, 343, 262]
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0), use_tqdm=False)[0]
    tokens = first.outputs[0].token_ids
    again = llm.generate(
        [prompt + tokens], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    lps = again.prompt_logprobs
    assert len(lps) == len(prompt) + len(tokens) and lps[0] is None
    for j, t in enumerate(tokens):
        entry = lps[len(prompt) + j]
        assert entry[t].logprob == pytest.approx(first.outputs[0].logprobs[j][t].logprob, abs=1e-4)
        assert entry[t].rank == 1  # greedy: the best
    ids = prompt + tokens
    for j, entry in enumerate(lps[1:], 1):  # the prompt's token and the 2 best alternatives
        assert ids[j] in entry and len(entry) <= 3
        assert {lp.rank for t, lp in entry.items() if t != ids[j]} <= {1, 2}


def test_prompt_logprobs_skip_the_prefix_cache(llm):
    """A cached prefix computes no logits: a request with prompt_logprobs computes every prompt token."""
    prompt = list(range(10, 80))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and all(e is not None for e in out.prompt_logprobs[1:])


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(regex="a("), "structured_outputs.regex"),
        (dict(grammar="start: nonsense_rule"), "structured_outputs.grammar"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json"),
    ],
)
def test_invalid_constraints_are_refused_by_name(llm, kw, param):
    with pytest.raises(ParameterError) as e:
        llm.generate(["x"], constrained(**kw), use_tqdm=False)
    assert e.value.param == param
    assert not llm.llm_engine.has_unfinished_requests()


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ParameterError) as e:
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert e.value.param == "logit_bias"
