"""The completion-style task suite (workloads/completion_tasks.py): exact lengths, needles where the depths say,
the prompt ending in the answer's sentence, determinism, and exact-match scoring of completions."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sparseserve.workloads import completion_tasks as C
from sparseserve.workloads import tasks as T
from tests.bench.conftest import haystack_dir


def _find(seq: list[int], sub: list[int]) -> list[int]:
    """Start positions of `sub` in `seq`."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i : i + n] == sub]


@pytest.mark.parametrize("task", C.TASKS)
@pytest.mark.parametrize("length", [700, 1600])
def test_exact_length_needles_and_query(builder, task, length):
    s = C.build(builder, task, length, 3, seed=0)
    assert s.task == task and s.length == length and len(s.prompt_ids) == length
    assert s.prompt_ids[: len(builder.bos)] == builder.bos
    text = s.prompt_text
    if task == "needle_multivalue":
        (key,) = s.meta["keys"]
        assert s.answer == ", ".join(s.meta["values"])
        for v in s.meta["values"]:  # every value's needle is in the context, once
            assert _find(s.prompt_ids, builder.enc(C.MV_NEEDLE.format(key, v))) != []
            assert text.count(v) == 1
        assert s.prompt_ids[-len(builder.enc(C.MV_QUERY.format(key))) :] == builder.enc(C.MV_QUERY.format(key))
    elif task == "extract_record":
        # The records are consecutive lines, the asked one among them with its code.
        lines = [x for x in text.splitlines() if x.startswith("The special magic number for the ")]
        assert len(lines) == C.NUM_RECORDS == len(s.meta["keys"])
        assert lines[s.meta["asked_index"]] == f"The special magic number for the {s.meta['asked']} is {s.answer}."
        assert "\n".join(lines) in text
        assert re.fullmatch(r"\d{4}(-\d{4}){%d}" % (C.CODE_GROUPS - 1), s.answer)
        query = builder.enc(C.QUERY.format(s.meta["asked"]))
        assert s.prompt_ids[-len(query) :] == query
    else:
        keys = s.meta["keys"]
        assert len(keys) == (4 if task == "needle_multikey" else 1) and s.meta["asked"] in keys
        for k in keys:  # every key's needle is in the context, once
            assert len(_find(s.prompt_ids, builder.enc(C.NEEDLE.format(k, "")[:-1]))) == 1
        assert _find(s.prompt_ids, builder.enc(C.NEEDLE.format(s.meta["asked"], s.answer))) != []
        query = builder.enc(C.QUERY.format(s.meta["asked"]))
        assert s.prompt_ids[-len(query) :] == query  # the prompt ends inside the answer's sentence
    assert builder.enc(" " + s.answer) == s.answer_ids


def test_depth_sweep_places_the_needle(builder):
    """needle_depth sample i sits at DEPTHS[i % 11] of the haystack: at the start, at the end and in order."""
    length = 1500
    head = len(builder.bos) + len(builder.enc(C.HEADER))
    positions, rooms = [], []
    for i in range(len(C.DEPTHS)):
        s = C.build(builder, "needle_depth", length, i, seed=1)
        assert s.meta["depth"] == C.DEPTHS[i]
        needle = builder.enc(C.NEEDLE.format(s.meta["asked"], s.answer))
        (at,) = _find(s.prompt_ids, needle)
        room = length - head - len(builder.enc(C.QUERY.format(s.meta["asked"]))) - len(needle)
        positions.append((at - head) / room)
        rooms.append(room)
    assert positions[0] == 0.0  # right after the header
    assert positions[-1] == pytest.approx(1.0)  # right before the query
    assert positions == sorted(positions)
    # Needles go to the sentence boundary nearest their depth: within a long sentence of it.
    assert all(abs(p - d) < 150 / r for p, d, r in zip(positions, C.DEPTHS, rooms))


def test_multikey_depths_and_distractors(builder):
    s = C.build(builder, "needle_multikey", 2000, 0, seed=5)
    assert len(set(s.meta["keys"])) == 4
    assert s.prompt_text.count("The special magic number for the") == 4 + 1  # the query's own
    values = re.findall(r"magic number for the \w+ is (\d+)\.", s.prompt_text)
    assert len(values) == 4 and s.answer in values and len(set(values)) == 4


def test_deterministic_and_independent(builder):
    a = C.build_suite(builder, ["needle_multikey", "extract_record"], [600], 3, seed=7)
    b = C.build_suite(builder, ["needle_multikey", "extract_record"], [600], 3, seed=7)
    c = C.build_suite(builder, ["needle_multikey", "extract_record"], [600], 3, seed=8)
    assert [(s.prompt_ids, s.answer) for s in a] == [(s.prompt_ids, s.answer) for s in b]
    assert [s.answer for s in a] != [s.answer for s in c]
    d = C.build_suite(builder, ["extract_record"], [600], 2, seed=7)  # other tasks and counts change nothing
    assert [s.prompt_ids for s in d] == [s.prompt_ids for s in a[3:5]]
    with pytest.raises(ValueError, match="unknown completion task"):
        C.build(builder, "passkey", 600, 0, seed=0)


def test_scoring():
    one = T.TaskSample("needle_single", 10, [], "1234567", [], {})
    assert C.score(one, " 1234567.") == 1.0
    assert C.score(one, " 1234567.\nThe special magic number") == 1.0
    assert C.score(one, "1234567, which is") == 1.0
    assert C.score(one, " 12345678") == 0.0
    assert C.score(one, " 123456") == 0.0
    assert C.score(one, " the number 1234567") == 0.0
    assert C.score(one, "") == 0.0
    code = T.TaskSample("extract_record", 10, [], "1234-5678", [], {})
    assert C.score(code, " 1234-5678.") == 1.0
    assert C.score(code, " 1234-5678-9") == 0.0  # a copy that runs on is not the record's code
    assert C.score(code, " 1234-567") == 0.0
    mv = T.TaskSample(
        "needle_multivalue", 10, [], "1111, 2222, 3333, 4444", [], {"values": ["1111", "2222", "3333", "4444"]}
    )
    assert C.score(mv, " 4444, 3333, 1111 and 2222.") == 1.0
    assert C.score(mv, ":\n1. 1111\n2. 2222\n3. 3333\n4. 4444") == 1.0  # a numbered list
    assert C.score(mv, " 1111, 1111, 2222.") == 0.5  # repeats count once
    assert C.score(mv, " 1111, 22220, 3333.1") == 0.5  # whole numbers only
    assert C.score(mv, "") == 0.0
    assert C.max_tokens(mv) > C.max_tokens(one) >= len(one.answer_ids)


def test_smollm2_tokenizer_lengths():
    """The suite at SmolLM2's tokenizer (digits one token each, no BOS), when the package is installed."""
    from sparseserve.bench.accuracy import load_tokenizer

    try:
        tok = load_tokenizer("smollm2")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    b = T.TaskBuilder(tok, T.load_essays(haystack_dir()))
    for task in C.TASKS:
        s = C.build(b, task, 2048, 0, seed=0)
        assert len(s.prompt_ids) == 2048
        assert len(s.answer_ids) >= C.VALUE_DIGITS - 2
    assert np.all(np.diff([C.build(b, "needle_depth", 1024, i, 0).meta["depth"] for i in range(11)]) > 0)
