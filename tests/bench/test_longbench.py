"""LongBench's request mix (workloads/longbench.py, `bench serve --dataset longbench`): the datasets' shares, each
dataset's length quantiles against the table over many draws, the tokenizer ratios, the cap that cuts the
prompt's middle, the outputs, and the seed."""

from __future__ import annotations

import argparse
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from sparseserve.workloads import longbench as L
from sparseserve.bench import serve
from sparseserve.workloads.datasets import PromptBuilder, cut_middle, data_dir

TOTAL = sum(d.samples for d in L.DATASETS)


def test_the_table_is_longbench_v1s_ten_datasets():
    assert TOTAL == 2550 and len({d.name for d in L.DATASETS}) == 10
    assert all(d.p10 < d.p50 < d.p90 <= d.max and d.mean_gen <= d.max_gen for d in L.DATASETS)


def test_datasets_are_drawn_in_proportion_to_their_samples():
    n = 100_000
    counts = Counter(r.dataset for r in L.sample_requests(n, seed=1))
    for d in L.DATASETS:
        assert counts[d.name] / n == pytest.approx(d.samples / TOTAL, abs=0.005), d.name


@pytest.mark.parametrize("d", L.DATASETS, ids=lambda d: d.name)
def test_each_datasets_lengths_have_the_tables_quantiles(d):
    x = L.draw_lengths(d, 40_000, np.random.default_rng(3))
    for q, want in ((10, d.p10), (50, d.p50), (90, d.p90)):
        assert np.percentile(x, q) == pytest.approx(want, rel=0.03), (q, want)
    assert x.max() <= d.max and x.min() >= 1  # clipped at the dataset's longest prompt
    assert (x == d.max).mean() < 0.1
    if d.name == "narrativeqa":  # its longest prompt is 1.2x its p90: the clip bites
        assert (x == d.max).mean() > 0.01


def test_the_mixtures_mean_under_a_32k_cap_matches_the_table():
    """The table's summary: about 9.2K Llama-3 and 11.6K Llama-2 tokens a prompt under a 32K cap."""
    for tokenizer, want in (("llama3", 9200), ("llama2", 11600)):
        reqs = L.sample_requests(50_000, seed=2, tokenizer=tokenizer, max_input_len=32768)
        assert np.mean([r.prompt_len for r in reqs]) == pytest.approx(want, rel=0.03), tokenizer


def test_llama2_lengths_are_the_same_draws_times_the_datasets_ratio():
    l3 = L.sample_requests(5000, seed=4)
    l2 = L.sample_requests(5000, seed=4, tokenizer="llama2")
    ratio = {d.name: d.llama2_ratio for d in L.DATASETS}
    assert [r.dataset for r in l2] == [r.dataset for r in l3]
    for a, b in zip(l3, l2):
        assert abs(b.full_len - a.full_len * ratio[a.dataset]) <= 0.5 + ratio[a.dataset] / 2
    assert max(r.full_len for r in l2 if r.dataset == "dureader") == round(22500 * 1.77)


def test_the_cap_keeps_the_draws_and_cuts_the_prompt():
    free = L.sample_requests(3000, seed=5)
    capped = L.sample_requests(3000, seed=5, max_input_len=8192)
    assert [r.full_len for r in capped] == [r.full_len for r in free]
    assert [r.prompt_len for r in capped] == [min(r.full_len, 8192) for r in free]
    assert any(r.full_len > 8192 for r in free)
    with pytest.raises(ValueError):
        L.sample_requests(3, seed=0, max_input_len=0)


def test_outputs_are_the_datasets_caps_means_or_one_length():
    by_name = {d.name: d for d in L.DATASETS}
    for r in L.sample_requests(500, seed=6):
        assert r.output_len == by_name[r.dataset].max_gen
    for r in L.sample_requests(500, seed=6, output="mean"):
        assert r.output_len == by_name[r.dataset].mean_gen
    assert {r.output_len for r in L.sample_requests(50, seed=6, output_len=1024)} == {1024}
    with pytest.raises(ValueError):
        L.sample_requests(5, seed=0, tokenizer="gpt2")


def test_the_seed_fixes_the_requests():
    assert L.sample_requests(200, seed=7) == L.sample_requests(200, seed=7)
    assert L.sample_requests(200, seed=7) != L.sample_requests(200, seed=8)


def test_cut_middle_keeps_both_ends():
    assert cut_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert cut_middle("abcdefg", 3) == "aefg"[:1] + "fg"
    assert cut_middle([1, 2], 5) == [1, 2]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_cli_args(p)
    return p.parse_args(list(argv))


def test_serve_specs_of_the_longbench_mix():
    builder = SimpleNamespace(prompt=lambda n, seed, keep=None: f"{n}:{keep}:{seed}")
    args = _args(
        "--dataset",
        "longbench",
        "--num-prompts",
        "40",
        "--max-input-len",
        "16K",
        "--seed",
        "3",
        "--longbench-tokenizer",
        "llama2",
    )
    slow, fast = serve._specs(args, builder, 0.5), serve._specs(args, builder, 4.0)
    reqs = L.sample_requests(40, 3, "llama2", 16384)
    assert [(s.prompt_len, s.output_len) for s in slow] == [(r.prompt_len, r.output_len) for r in reqs]
    assert [s.prompt for s in slow] == [s.prompt for s in fast]  # the same requests at every rate
    assert [s.arrival_s for s in fast] == serve.poisson_arrivals(40, 4.0, 3)
    assert slow[0].prompt == f"{reqs[0].full_len}:{reqs[0].prompt_len}:3:lb:0"
    fixed = serve._specs(
        _args("--dataset", "longbench", "--num-prompts", "5", "--trace-output-len", "1024"), builder, 1.0
    )
    assert {s.output_len for s in fixed} == {1024}
    with pytest.raises(ValueError, match="--trace"):
        serve.main(_args("--dataset", "longbench", "--trace", "t.jsonl"))


@pytest.mark.skipif(not (data_dir() / "haystack").is_dir(), reason="essay haystack (../shared/data) not found")
def test_a_capped_prompt_is_the_full_prompts_two_ends():
    from transformers import AutoTokenizer

    from sparseserve.models.loader import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    builder = PromptBuilder(tok)
    full, cut = builder.prompt(3000, "s"), builder.prompt(3000, "s", keep=1001)
    assert len(tok.encode(cut)) == 1001 and len(tok.encode(full)) == 3000  # as the server counts, BOS included
    ids, cut_ids = tok.encode(full, add_special_tokens=False), tok.encode(cut, add_special_tokens=False)
    assert cut_ids[:400] == ids[:400] and cut_ids[-400:] == ids[-400:]
    chars = PromptBuilder(chars_per_token=4.0)
    assert len(chars.prompt(3000, "s", keep=1000)) == 4000
    assert chars.prompt(3000, "s", keep=1000)[:2000] == chars.prompt(3000, "s")[:2000]
