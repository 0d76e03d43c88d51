"""The README's first command from a plain clone: without the essays the needle demo uses built-in filler
sentences, says so on stderr, and the embedded model still finds the needle."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from sparseserve import LLM, SamplingParams
from sparseserve.workloads import tasks
from sparseserve.models.loader import resolve_model_dir


@pytest.mark.slow
def test_demo_prompt_without_essays(monkeypatch, capsys):
    def missing(explicit=None):
        raise FileNotFoundError("essay haystack not found")

    monkeypatch.setattr(tasks, "find_haystack_dir", missing)
    tasks._main(["niah_single", "1024"])
    out, err = capsys.readouterr()
    assert "built-in filler" in err
    answer = re.search(r"expected answer: (\d+)", err).group(1)
    assert f"is {answer}." in out and "Question: What is the secret number of the" in out
    sentences = [s for s in tasks.split_sentences(out) if s.startswith("The ")]
    assert len(sentences) > 50 and len(set(sentences)) > 10  # noise, not one sentence repeated

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    sample = tasks.TaskBuilder(tok, tasks.builtin_filler()).build(
        "niah_single", 1024, tasks.sample_rng(0, "niah_single", 1024, 0)
    )
    assert sample.answer == answer and len(sample.prompt_ids) == 1024
    llm = LLM(device="cpu", max_model_len=1100)
    text = (
        llm.generate([sample.prompt_ids], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert tasks.is_correct(text, answer), (text, answer)


def test_builtin_filler_is_deterministic_and_long_enough():
    a, b = tasks.builtin_filler(), tasks.builtin_filler()
    assert a == b and len(tasks.split_sentences(a[0])) == 3000
    assert tasks.builtin_filler(seed=1) != a
