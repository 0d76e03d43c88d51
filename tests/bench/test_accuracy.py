"""RULER-style tasks, exact-match scoring, policy parsing, the attention probe and the accuracy harness
end to end on CPU with the embedded default model (its accuracy is not the point here: the machinery is)."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata, BackendContext, PagedAttentionBackend, attend_paged
from sparseserve.bench import accuracy
from sparseserve.workloads import tasks as T
from sparseserve.bench.attention_probe import AttentionProbe
from sparseserve.kernels.store_kv import store_kv
from tests.bench.conftest import haystack_dir


def test_tasks_exact_length_and_needles(builder):
    for task in T.TASKS:
        for length in (600, 1500):
            s = builder.build(task, length, T.sample_rng(0, task, length, 0))
            assert len(s.prompt_ids) == length
            assert s.prompt_ids[: len(builder.bos)] == builder.bos
            text = s.prompt_text
            assert text.rstrip().endswith("Answer:")
            for part in s.answer.split():  # the needle (or every variable of the chain) is in the prompt
                assert part in text, (task, part)


def test_tasks_deterministic(builder):
    a = T.build_suite(builder, ["passkey", "niah_multikey", "kv_retrieval"], [512], 3, seed=7)
    b = T.build_suite(builder, ["passkey", "niah_multikey", "kv_retrieval"], [512], 3, seed=7)
    c = T.build_suite(builder, ["passkey", "niah_multikey", "kv_retrieval"], [512], 3, seed=8)
    assert [(s.prompt_ids, s.answer) for s in a] == [(s.prompt_ids, s.answer) for s in b]
    assert [s.answer for s in a] != [s.answer for s in c]
    # A sample does not change when other tasks or more samples join the run.
    d = T.build_suite(builder, ["kv_retrieval"], [512], 2, seed=7)
    assert [s.prompt_ids for s in d] == [s.prompt_ids for s in a[6:8]]


def test_multikey_has_distractors(builder):
    s = builder.build("niah_multikey", 2000, np.random.default_rng(3))
    assert len(s.meta["keys"]) == 4 and s.meta["asked"] in s.meta["keys"]
    assert s.prompt_text.count("The secret number of the") == 4


def test_answer_checking():
    assert T.is_correct(" 12345", "12345")
    assert T.is_correct("12345\nQuestion: more text", "12345")
    assert T.is_correct("\n ABCDE FGHIJ \n", "ABCDE FGHIJ")
    assert not T.is_correct("1234", "12345")
    assert not T.is_correct("12345 and more", "12345")
    assert not T.is_correct("", "12345")


def test_parse_policy():
    # Dense by its options, not the engine's defaults (which may turn sparse).
    assert accuracy.parse_policy("dense").engine_args == {"sparse_policy": "dense", "sparse_prefill": "dense"}
    p = accuracy.parse_policy("mine:sparse_policy=topk,sparse_budget=1024,reuse=false,p=0.9")
    assert p.name == "mine"
    assert p.engine_args == {"sparse_policy": "topk", "sparse_budget": 1024, "reuse": False, "p": 0.9}
    # A selection policy's name sets sparse_policy; with arguments its label is the whole spec (budgets side by side).
    assert accuracy.parse_policy("topk") == accuracy.Policy("topk", {"sparse_policy": "topk"})
    p = accuracy.parse_policy("topk:sparse_budget=1024")
    assert p == accuracy.Policy("topk:budget=1024", {"sparse_policy": "topk", "sparse_budget": 1024})
    p = accuracy.parse_policy("topk1024_lag:sparse_budget=512")  # a preset, overridden
    assert p.name == "topk1024_lag:budget=512"
    assert p.engine_args == {"sparse_policy": "topk", "sparse_budget": 512, "sparse_lag": 1}
    with pytest.raises(ValueError):
        accuracy.parse_policy("no_such_policy")
    with pytest.raises(ValueError):
        accuracy.parse_policy("x:novalue")


def test_parse_policies_dense_first_and_unique():
    pols = accuracy.parse_policies(["topk:sparse_budget=512", "topk:sparse_budget=1024"])
    assert [p.name for p in pols] == ["dense", "topk:budget=512", "topk:budget=1024"]
    assert [p.name for p in accuracy.parse_policies(["topk1024", "dense"])] == ["dense", "topk1024"]
    with pytest.raises(ValueError, match="twice"):
        accuracy.parse_policies(["topk1024", "topk1024"])


def test_tokens_attended():
    # 30 selections of 10 blocks of 32 tokens between the snapshots: 320 tokens; none: the mean context.
    assert accuracy.tokens_attended((100, 7), (400, 37), 32, 5000.0) == 320.0
    assert accuracy.tokens_attended((100, 7), (100, 7), 32, 5000.0) == 5000.0


def test_depth_table():
    rows = [
        {"task": "needle_depth", "length": 8, "depth": d, "correct": c}
        for d, c in [(0.0, 1.0), (0.0, 0.0), (1.0, 1.0), (0.5, 0.0)]
    ] + [{"task": "needle_single", "length": 8, "depth": 0.3, "correct": 1.0}]
    table = accuracy.depth_table(rows)
    assert table == {"8": {"0.0": 0.5, "0.5": 0.0, "1.0": 1.0}}
    text = accuracy.format_depths({"dense": table})
    assert text.splitlines()[1].split() == ["dense", "@8", "50", "0", "100"]


def test_curve_and_its_table():
    results = {"dense": {"a": {"8": 1.0}, "b": {"8": 0.5}}, "topk": {"a": {"8": 0.5}, "b": {"8": 0.5}}}
    ppl = {"dense": {"8": {"ppl": 10.0}}, "topk": {"8": {"ppl": 11.0}}}
    attended = {"dense": {"8": 8.0}, "topk": {"8": 4.0}}
    pts = accuracy.curve(results, ppl, attended, [8])
    top = [c for c in pts if c["policy"] == "topk"][0]
    assert top["accuracy"] == 0.5 and top["accuracy_vs_dense"] == pytest.approx(-0.25)
    assert top["ppl_ratio"] == pytest.approx(1.1) and top["tokens_attended"] == 4.0
    table = accuracy.format_curve(pts)
    assert "topk" in table and "1.1000" in table and "-25.0" in table


def test_format_table_reference_first():
    res = {"topk": {"passkey": {"512": 0.5}}, "dense": {"passkey": {"512": 1.0}}}
    table = accuracy.format_table(res, ["passkey"], [512])
    header, row = table.splitlines()
    assert header.index("dense") < header.index("topk")
    assert "100.0" in row and "50.0 (-50)" in row


class _HalfBackend(PagedAttentionBackend):
    """Attends to the first block of every request only, and says so (as a sparse policy would)."""

    def _forward(self, layer_idx, q, k, v, kv_cache, meta, scale):
        store_kv(k, v, kv_cache, meta.slot_mapping)
        cut = AttentionMetadata(
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens.clamp(max=kv_cache.shape[3]),
            meta.block_tables,
            meta.num_decodes,
            meta.max_query_len,
            kv_cache.shape[3],
        )
        return attend_paged(q, kv_cache, cut, scale)

    def attended_blocks(self, layer_idx, meta):
        sel = torch.zeros(meta.num_decodes, 2, meta.block_tables.shape[1], dtype=torch.bool)
        sel[:, :, 0] = True
        return sel


@pytest.mark.parametrize("backend_cls", [PagedAttentionBackend, _HalfBackend])
def test_probe_mass_and_error(backend_cls):
    torch.manual_seed(0)
    num_blocks, hkv, bs, d, hq, n = 6, 2, 4, 8, 4, 14  # one decode request with 14 tokens of context
    cache = torch.randn(num_blocks, hkv, 2, bs, d)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([n - 1]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[3, 0, 5, 1]], dtype=torch.int32),
        num_decodes=1,
        max_query_len=1,
        max_seq_len=n,
    )
    q, k, v = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    backend = backend_cls(BackendContext(1, hkv, d, bs, torch.float32, torch.device("cpu"), 1, 64))
    with AttentionProbe(backend) as probe:
        backend.forward(0, q, k, v, cache, meta, d**-0.5)
    assert not backend.observers  # removed again
    rep = probe.report()["layers"]["0"]
    if backend_cls is PagedAttentionBackend:
        assert rep["mass_mean"] == pytest.approx(1.0) and rep["rel_err_max"] < 1e-5
    else:  # mass on the first block, recomputed by hand
        keys = cache[[3, 0, 5, 1], :, 0].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q[0].view(hkv, 2, d), keys) * d**-0.5, -1)
        assert rep["mass_mean"] == pytest.approx(probs[..., :bs].sum(-1).mean().item(), rel=1e-5)
        assert rep["mass_mean"] < 1 and rep["rel_err_mean"] > 1e-3
        # Oracles at the same budget (one block = 4 tokens per KV head), by hand: the block of largest mean
        # mass over the group, and each head's own 4 largest probabilities.
        blocks = torch.nn.functional.pad(probs, (0, 16 - n)).view(hkv, 2, 4, bs).sum(-1)
        best = blocks.gather(2, blocks.mean(1).argmax(-1)[:, None, None].expand(hkv, 2, 1))
        assert rep["oracle_block_mean"] == pytest.approx(best.mean().item(), rel=1e-5)
        assert rep["oracle_token_mean"] == pytest.approx(probs.topk(bs, -1).values.sum(-1).mean().item(), rel=1e-5)
        assert rep["mass_mean"] <= rep["oracle_block_mean"] + 1e-6 <= rep["oracle_token_mean"] + 2e-6
    assert rep["oracle_block_mean"] == pytest.approx(1.0) or backend_cls is not PagedAttentionBackend


@pytest.mark.slow
def test_harness_end_to_end_cpu(tmp_path, capsys):
    haystack_dir()
    parser = argparse.ArgumentParser()
    accuracy.add_cli_args(parser)
    out = tmp_path / "acc.json"
    args = parser.parse_args(
        [
            "--lengths",
            "256,384",
            "--num-samples",
            "2",
            "--tasks",
            "passkey,niah_single",
            "--policies",
            "dense",
            "dense2:attention_backend=torch",
            "--device",
            "cpu",
            "--output",
            str(out),
            "--quiet",
            "--probe-steps",
            "2",
            "--probe-samples",
            "1",
            "--ppl-tokens",
            "0",
        ]
    )
    res = accuracy.main(args)
    printed = capsys.readouterr().out
    assert "dense" in printed and "dense2" in printed and "niah_single" in printed
    data = json.loads(out.read_text())
    assert list(data["accuracy"]) == ["dense", "dense2"]
    for pol in ("dense", "dense2"):
        assert set(data["accuracy"][pol]) == {"passkey", "niah_single"}
        assert set(data["accuracy"][pol]["passkey"]) == {"256", "384"}
        assert len(data["samples"][pol]) == 8
        layers = data["probe"][pol]["layers"]
        assert layers and all(r["mass_min"] == pytest.approx(1.0) for r in layers.values())
    # Same engine math under both labels: the same greedy tokens.
    assert [r["output_token_ids"] for r in data["samples"]["dense"]] == [
        r["output_token_ids"] for r in data["samples"]["dense2"]
    ]
    assert res["accuracy"] == data["accuracy"]


def test_harness_completion_suite_end_to_end(tmp_path, capsys):
    """The completion suite with perplexity, a sparse policy, the probe, the curve and its plot."""
    haystack_dir()
    parser = argparse.ArgumentParser()
    accuracy.add_cli_args(parser)
    out, png = tmp_path / "acc.json", tmp_path / "curve.png"
    args = parser.parse_args(
        [
            "--suite",
            "completion",
            "--lengths",
            "320",
            "--samples",
            "3",
            "--tasks",
            "needle_single,needle_multivalue,extract_record",
            "--policies",
            "topk:sparse_budget=192,sparse_dense_layers=0",
            "--device",
            "cpu",
            "--ppl-tokens",
            "12",
            "--ppl-samples",
            "2",
            "--probe-steps",
            "1",
            "--probe-samples",
            "1",
            "--output",
            str(out),
            "--plot",
            str(png),
            "--quiet",
        ]
    )
    res = accuracy.main(args)
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "tokens attended" in printed and "needle_multivalue" in printed
    sparse = "topk:budget=192,dense_layers=0"
    data = json.loads(out.read_text())
    assert data["suite"] == "completion" and list(data["accuracy"]) == ["dense", sparse]
    assert set(data["accuracy"][sparse]) == {"needle_single", "needle_multivalue", "extract_record"}
    # Dense attends the whole context; the sparse policy 6 blocks of 32 tokens at most.
    assert data["mean_tokens_attended"]["dense"]["320"] == 320
    assert 0 < data["mean_tokens_attended"][sparse]["320"] <= 192
    assert 0 < data["mean_tokens_attended_ppl"][sparse]["320"] <= 192
    for pol in ("dense", sparse):
        assert data["perplexity"][pol]["320"]["tokens"] == 2 * 12
        assert math.isfinite(data["perplexity"][pol]["320"]["ppl"])
        assert data["probe"][pol]["layers"]
    assert all(r["mass_min"] == pytest.approx(1.0) for r in data["probe"]["dense"]["layers"].values())
    assert min(r["mass_mean"] for r in data["probe"][sparse]["layers"].values()) < 1.0
    points = {c["policy"]: c for c in data["curve"]}
    assert points["dense"]["ppl_ratio"] == 1.0 and points[sparse]["ppl_ratio"] > 0
    assert png.stat().st_size > 0
    assert res["curve"] == data["curve"]
    # --samples 3 over 3 tasks: one each; the paired difference to dense over those 3, with the curve's mean.
    assert data["num_samples"] == 1 and data["samples_per_policy"] == 3
    assert "paired difference to dense" in printed and "bootstrap" in data["paired_method"]
    (pair,) = data["paired"]
    assert pair["policy"] == sparse and pair["length"] == 320 and pair["n"] == 3
    assert pair["diff"] == pytest.approx(points[sparse]["accuracy_vs_dense"])
    assert pair["diff_low"] <= pair["diff"] <= pair["diff_high"]
    assert pair["ppl_ratio"] == pytest.approx(points[sparse]["ppl_ratio"])
    assert pair["tokens_attended"] == data["mean_tokens_attended"][sparse]["320"]
    assert isinstance(pair["within_1_point"], bool)


def test_harness_reports_sparse_prefill_tiles(tmp_path, capsys):
    """A sparse-prefill policy gets its share of dense's prefill tiles: all of them at threshold 0 (and then the
    same outputs as dense), fewer with a threshold no element clears; dense prefill reports none."""
    haystack_dir()
    parser = argparse.ArgumentParser()
    accuracy.add_cli_args(parser)
    out = tmp_path / "acc.json"
    args = parser.parse_args(
        [
            "--suite",
            "completion",
            "--lengths",
            "640",
            "--num-samples",
            "1",
            "--tasks",
            "needle_single",
            "--device",
            "cpu",
            "--ppl-tokens",
            "0",
            "--probe-steps",
            "0",
            "--output",
            str(out),
            "--quiet",
            "--policies",
            "all:sparse_prefill=sale,sparse_prefill_min_len=0,sparse_prefill_threshold=0",
            "few:sparse_prefill=sale,sparse_prefill_min_len=0,sparse_prefill_threshold=1e6",
        ]
    )
    accuracy.main(args)
    assert "prefill tiles" in capsys.readouterr().out
    data = json.loads(out.read_text())
    tiles = data["prefill_tiles_computed"]
    assert "dense" not in tiles and tiles["all"]["640"] == pytest.approx(1.0)
    assert 0 < tiles["few"]["640"] < 1.0
    assert data["samples"]["all"][0]["output_token_ids"] == data["samples"]["dense"][0]["output_token_ids"]
