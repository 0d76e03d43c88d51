"""The README's demo prompt generator stays light: no torch or transformers import (seconds on a small CPU), and
the embedded model's raw tokenizer.json builds the same prompt as its transformers tokenizer."""

from __future__ import annotations

import subprocess
import sys

from sparseserve.workloads.tasks import TaskBuilder, builtin_filler, sample_rng


def test_the_demo_generator_imports_neither_torch_nor_transformers():
    code = (
        "import sys, sparseserve, sparseserve.workloads.tasks as t; "
        "t._main(['niah_single', '256']); "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy; assert sparseserve.SamplingParams is not None"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Question:" in res.stdout


def test_raw_tokenizer_builds_the_same_prompt():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from sparseserve.models.loader import DEFAULT_MODEL_DIR

    auto = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    raw = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    essays = builtin_filler()
    a, b = (
        TaskBuilder(tok, essays).build("niah_single", 1024, sample_rng(0, "niah_single", 1024, 0))
        for tok in (auto, raw)
    )
    assert a.prompt_text == b.prompt_text and a.answer == b.answer
    assert len(auto.encode(a.prompt_text)) == 1024
