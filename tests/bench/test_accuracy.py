"""RULER-style tasks, exact-match scoring, policy parsing, the attention probe and the accuracy harness
end to end on CPU with the embedded default model (its accuracy is not the point here: the machinery is)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata, BackendContext, PagedAttentionBackend, attend_paged
from sparseserve.kernels.store_kv import store_kv
from sparseserve.bench import accuracy
from sparseserve.bench import tasks as T
from sparseserve.bench.attention_probe import AttentionProbe


def _haystack_dir():
    try:
        return T.find_haystack_dir()
    except FileNotFoundError:
        pytest.skip("essay haystack (../shared/data/haystack) not found")


@pytest.fixture(scope="module")
def builder():
    from transformers import AutoTokenizer
    from sparseserve.models.loader import DEFAULT_MODEL_DIR
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    return T.TaskBuilder(tok, T.load_essays(_haystack_dir()), eos_id=tok.eos_token_id)


def test_tasks_exact_length_and_needles(builder):
    for task in T.TASKS:
        for length in (600, 1500):
            s = builder.build(task, length, T.sample_rng(0, task, length, 0))
            assert len(s.prompt_ids) == length
            assert s.prompt_ids[:len(builder.bos)] == builder.bos
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
    assert accuracy.parse_policy("dense").engine_args == {}
    p = accuracy.parse_policy("topk:sparse_policy=topk,sparse_budget=1024,reuse=false,p=0.9")
    assert p.name == "topk"
    assert p.engine_args == {"sparse_policy": "topk", "sparse_budget": 1024, "reuse": False, "p": 0.9}
    with pytest.raises(ValueError):
        accuracy.parse_policy("no_such_policy")
    with pytest.raises(ValueError):
        accuracy.parse_policy("x:novalue")


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
        cut = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens.clamp(max=kv_cache.shape[3]),
                                meta.block_tables, meta.num_decodes, meta.max_query_len, kv_cache.shape[3])
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
    meta = AttentionMetadata(slot_mapping=torch.tensor([n - 1]),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.tensor([[3, 0, 5, 1]], dtype=torch.int32),
                             num_decodes=1, max_query_len=1, max_seq_len=n)
    q, k, v = torch.randn(1, hq, d), torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    backend = backend_cls(BackendContext(1, hkv, d, bs, torch.float32, torch.device("cpu"), 1, 64))
    with AttentionProbe(backend) as probe:
        backend.forward(0, q, k, v, cache, meta, d ** -0.5)
    assert not backend.observers  # removed again
    rep = probe.report()["layers"]["0"]
    if backend_cls is PagedAttentionBackend:
        assert rep["mass_mean"] == pytest.approx(1.0) and rep["rel_err_max"] < 1e-5
    else:  # mass on the first block, recomputed by hand
        keys = cache[[3, 0, 5, 1], :, 0].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q[0].view(hkv, 2, d), keys) * d ** -0.5, -1)
        assert rep["mass_mean"] == pytest.approx(probs[..., :bs].sum(-1).mean().item(), rel=1e-5)
        assert rep["mass_mean"] < 1 and rep["rel_err_mean"] > 1e-3


@pytest.mark.slow
def test_harness_end_to_end_cpu(tmp_path, capsys):
    _haystack_dir()
    parser = argparse.ArgumentParser()
    accuracy.add_cli_args(parser)
    out = tmp_path / "acc.json"
    args = parser.parse_args(["--lengths", "256,384", "--num-samples", "2", "--tasks", "passkey,niah_single",
                              "--policies", "dense", "dense2:attention_backend=torch", "--device", "cpu",
                              "--output", str(out), "--quiet", "--probe-steps", "2", "--probe-samples", "1"])
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
    assert [r["output_token_ids"] for r in data["samples"]["dense"]] == \
           [r["output_token_ids"] for r in data["samples"]["dense2"]]
    assert res["accuracy"] == data["accuracy"]
