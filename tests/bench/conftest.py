"""Fixtures shared by the benchmark tests: the essays and a task builder over the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from sparseserve.workloads import tasks as T


def haystack_dir():
    try:
        return T.find_haystack_dir()
    except FileNotFoundError:
        pytest.skip("essay haystack (../shared/data/haystack) not found")


@pytest.fixture(scope="module")
def builder():
    from transformers import AutoTokenizer

    from sparseserve.models.loader import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    return T.TaskBuilder(tok, T.load_essays(haystack_dir()), eos_id=tok.eos_token_id)
