"""Completion-style long-context tasks for small instruct models (RULER's base-model templates).

A small model (SmolLM2-135M) does not answer "Question: ... Answer:" reliably, but it completes a sentence it
has read: every prompt here ends with the beginning of the sentence that holds the answer ("... The special
magic number for the lantern mentioned in the provided text is") and the model's continuation is scored.

  needle_single      one needle in the essays, at a random depth
  needle_multikey    four needles with different keys; the query asks for one (the others are distractors)
  needle_depth       one needle at a depth swept over the context: sample i sits at DEPTHS[i % len(DEPTHS)]
  needle_multivalue  four values for one key; the query asks for all of them (scored by the share of the values
                     the completion holds, RULER's metric for this task)
  extract_record     a list of four records (one per line, at a random depth) whose codes have 16 digits; the
                     query names one record, whose code must be copied exactly (19 tokens)

Prompts are built at an exact token length by workloads/tasks.py's TaskBuilder (the essays' token corpus and its
assembly of needles at sentence boundaries). Scoring (`score`) is exact match on the completion: it must start
with the answer as a whole word; for needle_multivalue, the share of the values that appear in it as whole
numbers (SmolLM2 lists them in several formats: "a, b, c", a numbered list, with repeats).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from sparseserve.workloads.tasks import KEY_WORDS, TaskBuilder, TaskSample

TASKS = ("needle_single", "needle_multikey", "needle_depth", "needle_multivalue", "extract_record")
DEPTHS = tuple(i / 10 for i in range(11))  # needle_depth: 0%, 10%, ..., 100% of the haystack

HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = " The special magic number for the {} is {}."
QUERY = (
    "\nWhat is the special magic number for the {0} mentioned in the provided text? "
    "The special magic number for the {0} mentioned in the provided text is"
)
MV_NEEDLE = " One of the special magic numbers for the {} is {}."
MV_QUERY = (
    "\nWhat are all the special magic numbers for the {0} mentioned in the provided text? "
    "The special magic numbers for the {0} mentioned in the provided text are"
)
VALUE_DIGITS = 7


def _digits(rng: np.random.Generator, n: int = VALUE_DIGITS) -> str:
    return str(int(rng.integers(10 ** (n - 1), 10**n)))


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    return [KEY_WORDS[i] for i in rng.choice(len(KEY_WORDS), size=n, replace=False)]


def _needles(
    b: TaskBuilder, task: str, length: int, rng: np.random.Generator, num_keys: int, depth: float | None = None
) -> TaskSample:
    keys = _keys(rng, num_keys)
    values = [_digits(rng) for _ in keys]
    depths = [float(rng.random()) for _ in keys]
    q = int(rng.integers(num_keys))  # the key asked for; the others are distractors
    if depth is not None:
        depths[q] = depth
    hay, starts = b.essays.slice(rng, length)
    needles = [(d, NEEDLE.format(k, v)) for d, k, v in zip(depths, keys, values)]
    return b.assemble(
        task,
        length,
        HEADER,
        hay,
        starts,
        needles,
        QUERY.format(keys[q]),
        values[q],
        {"keys": keys, "asked": keys[q], "depth": depths[q]},
    )


def needle_single(b: TaskBuilder, length: int, rng: np.random.Generator, index: int) -> TaskSample:
    return _needles(b, "needle_single", length, rng, 1)


def needle_multikey(b: TaskBuilder, length: int, rng: np.random.Generator, index: int) -> TaskSample:
    return _needles(b, "needle_multikey", length, rng, 4)


def needle_depth(b: TaskBuilder, length: int, rng: np.random.Generator, index: int) -> TaskSample:
    return _needles(b, "needle_depth", length, rng, 1, depth=DEPTHS[index % len(DEPTHS)])


def needle_multivalue(
    b: TaskBuilder, length: int, rng: np.random.Generator, index: int, num_values: int = 4
) -> TaskSample:
    key = _keys(rng, 1)[0]
    values: list[str] = []
    while len(values) < num_values:
        v = _digits(rng)
        if v not in values:
            values.append(v)
    depths = sorted(float(d) for d in rng.random(num_values))
    hay, starts = b.essays.slice(rng, length)
    needles = [(d, MV_NEEDLE.format(key, v)) for d, v in zip(depths, values)]
    return b.assemble(
        "needle_multivalue",
        length,
        HEADER,
        hay,
        starts,
        needles,
        MV_QUERY.format(key),
        ", ".join(values),
        {"keys": [key], "values": values, "depths_sorted": depths},
    )


# -- extraction --------------------------------------------------------------------------------------------
NUM_RECORDS = 4
CODE_GROUPS = 4  # a code of four 4-digit groups: 19 tokens to copy with SmolLM2's tokenizer


def _code(rng: np.random.Generator) -> str:
    return "-".join(_digits(rng, 4) for _ in range(CODE_GROUPS))


def extract_record(b: TaskBuilder, length: int, rng: np.random.Generator, index: int) -> TaskSample:
    """A list of NUM_RECORDS look-alike records, one per line, at a random depth of the essays; the query names one
    and the completion must copy its code exactly. What it tests beyond the needles: the asked line sits among
    lines that differ in one key token (often in the same KV block), and every one of the ~19 decode steps of the
    copy must attend it again (SmolLM2-135M fails here by picking a neighbour's code or by breaking off mid-copy)."""
    keys = _keys(rng, NUM_RECORDS)
    codes = [_code(rng) for _ in keys]
    q = int(rng.integers(NUM_RECORDS))
    depth = float(rng.random())
    hay, starts = b.essays.slice(rng, length)
    block = "".join("\n" + NEEDLE.format(k, c).lstrip() for k, c in zip(keys, codes)) + "\n"
    return b.assemble(
        "extract_record",
        length,
        HEADER,
        hay,
        starts,
        [(depth, block)],
        QUERY.format(keys[q]),
        codes[q],
        {"keys": keys, "asked": keys[q], "asked_index": q, "depth": depth},
    )


GENERATORS: dict[str, Callable[[TaskBuilder, int, np.random.Generator, int], TaskSample]] = {
    "needle_single": needle_single,
    "needle_multikey": needle_multikey,
    "needle_depth": needle_depth,
    "needle_multivalue": needle_multivalue,
    "extract_record": extract_record,
}


def sample_rng(seed: int, task: str, length: int, index: int) -> np.random.Generator:
    """One stream per (seed, task, length, sample index), as in workloads/tasks.py (offset so that the two suites'
    streams differ)."""
    return np.random.default_rng([seed, 100 + TASKS.index(task), length, index])


def build(builder: TaskBuilder, task: str, length: int, index: int, seed: int) -> TaskSample:
    if task not in GENERATORS:
        raise ValueError(f"unknown completion task {task!r}: choose from {', '.join(TASKS)}")
    return GENERATORS[task](builder, length, sample_rng(seed, task, length, index), index)


def build_suite(
    builder: TaskBuilder, tasks: list[str], lengths: list[int], num_samples: int, seed: int
) -> list[TaskSample]:
    return [build(builder, t, n, i, seed) for t in tasks for n in lengths for i in range(num_samples)]


# -- scoring -------------------------------------------------------------------------------------------------
def score(sample: TaskSample, generated: str) -> float:
    """1.0 when the completion starts with the answer, not followed by a letter, digit or hyphen ("1234567." and
    "1234567, which" count; "12345678" and "1234-5678-9" do not), else 0.0. needle_multivalue: the share of the
    values that appear as whole numbers anywhere in the completion (which max_tokens bounds), in any order."""
    values = sample.meta.get("values")
    if values is not None:
        found = set(re.findall(r"\d+", generated))
        return sum(v in found for v in values) / len(values)
    text = generated.strip()
    after = text[len(sample.answer) : len(sample.answer) + 1]
    return float(text.startswith(sample.answer) and not (after.isalnum() or after == "-"))


def max_tokens(sample: TaskSample) -> int:
    """Generation room: the answer's tokens plus a few; for the multi-value list room for a numbered list."""
    values = sample.meta.get("values")
    if values is not None:
        return sum(len(v) + 5 for v in values) + 4
    return len(sample.answer_ids) + 4
