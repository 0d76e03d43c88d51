"""Sparse prefill through LLM.generate (CPU, torch path; GPU test at the end): threshold 0 gives dense prefill's
tokens with chunked prefill (chunks starting mid-context), GQA groups of 1, 3 and 4, and under KV offload; a
threshold computes fewer tiles and the run completes; streaming heads change exactly their heads' prefill output;
the calibration tool writes a file the engine loads."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.attention.prefill import load_prefill_thresholds
from tests.conftest import make_hf_model, offload_lag
from tests.kernel_utils import gpu_only

# Chunks of 160 tokens: the 450-token prompt's later chunks start mid-context with middle tiles to select (key
# tiles of 64 tokens, sink 1, local window 2); the short prompt stays a first chunk.
COMMON = dict(
    device="cpu", dtype="float32", block_size=16, max_model_len=512, max_num_batched_tokens=160, max_num_seqs=4
)
SALE0 = dict(sparse_prefill="sale", sparse_prefill_threshold=0.0, sparse_prefill_min_len=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompts(lengths=(450, 120)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def run(model_dir, prompt_lengths=(450, 120), **kw):
    llm = LLM(str(model_dir), **{**COMMON, **kw})
    outs = llm.generate(prompts(prompt_lengths), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.get_stats(sync=True), llm


@pytest.fixture(scope="module")
def group3_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa3")
    make_hf_model(
        path,
        "LlamaConfig",
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size=192,
        tie_word_embeddings=False,
    )
    return path


@pytest.mark.parametrize("variant", ["llama-mha-d64-untied", "group3", "qwen3-qknorm-d128"])
def test_threshold_zero_equals_dense(hf_models, group3_model, variant):
    """Query groups of 1, 3 and 4: sparse prefill keeping every tile gives dense prefill's tokens, and counts every
    causally visible tile as computed."""
    model = group3_model if variant == "group3" else hf_models[variant][0]
    dense, stats, _ = run(model)
    assert stats.prefill_tiles_dense == 0  # dense prefill has no tile counters
    sale, stats, _ = run(model, **SALE0)
    assert sale == dense
    assert stats.prefill_tiles_computed == stats.prefill_tiles_dense > 0


def test_offload_threshold_zero_equals_dense(hf_models):
    """Under KV offload (sparse decode) a prefilling sequence's blocks are addressed in the device block cache:
    sparse prefill at threshold 0 gives the tokens of dense prefill, with and without offload."""
    model = hf_models["qwen2-gqa-bias"][0]
    sparse = dict(sparse_policy="topk", sparse_budget=128, sparse_dense_layers=1, sparse_dense_context=0)
    sparse["sparse_lag"] = offload_lag(**COMMON, **sparse)["sparse_lag"]
    base, _, _ = run(model, **sparse)
    got, stats, llm = run(model, **sparse, **SALE0, kv_offload=True, hbm_cache_blocks=24)
    assert got == base
    assert stats.prefill_tiles_computed == stats.prefill_tiles_dense > 0 and stats.offload_layer_steps > 0
    assert stats.num_blocks_used == 0


def test_threshold_computes_fewer_tiles(group3_model):
    """A threshold drops tiles (the counters, /metrics) and the run completes; a prompt below min_len stays dense
    (the 120-token prompt's tiles are all computed, so the drop comes from the long one alone)."""
    outs, stats, _ = run(group3_model, sparse_prefill="sale", sparse_prefill_threshold=1.0, sparse_prefill_min_len=200)
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert 0 < stats.prefill_tiles_computed < stats.prefill_tiles_dense
    _, short, _ = run(
        group3_model,
        prompt_lengths=(120,),
        sparse_prefill="sale",
        sparse_prefill_threshold=1.0,
        sparse_prefill_min_len=200,
    )
    assert short.prefill_tiles_computed == short.prefill_tiles_dense > 0
    from sparseserve.metrics import ServerMetrics, parse_metrics

    got = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
    assert got["sparseserve:prefill_tiles_computed_total"] == stats.prefill_tiles_computed


def test_streaming_heads_change_prefill(hf_models, tmp_path):
    """A streaming KV head in layer 1 (of 2): the prefill attention output of its query heads changes (sink and
    local tiles only), every other head's stays bit for bit, and fewer tiles are computed."""
    model = hf_models["mistral-gqa"][0]  # 4 query heads, 2 KV heads
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"streaming_heads": {"1": [0]}}))

    def prefill_outputs(**kw):
        llm = LLM(str(model), **COMMON, **SALE0, **kw)
        seen = []

        def observe(layer, q, out, kv_cache, meta, scale):
            if layer == 1:  # the prefill tokens of the step (decodes come first, one token each)
                seen.append(out[meta.num_decodes :].clone())

        llm.llm_engine.model_runner.attn_backend.observers.append(observe)
        llm.generate(prompts((450,)), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        return torch.cat(seen), llm.llm_engine.get_stats(sync=True)

    plain, plain_stats = prefill_outputs()
    streamed, stats = prefill_outputs(streaming_heads=str(heads))
    assert plain.shape == streamed.shape == (450, 4, 32)
    assert torch.equal(plain[:, 2:], streamed[:, 2:])  # KV head 1's query heads
    late = slice(4 * 64, None)  # query tiles with middle tiles (the first ones see only forced tiles)
    assert ((plain[late, :2] - streamed[late, :2]).norm() / plain[late, :2].norm()) > 1e-3
    assert stats.prefill_tiles_computed < stats.prefill_tiles_dense == plain_stats.prefill_tiles_dense


def test_calibration_writes_a_file_the_engine_loads(hf_models, tmp_path, capsys):
    """calibrate --prefill on random prompts: one threshold per (layer, query head), each 0 or the start halved
    k times, and the file (with its layout and the tile fraction measured after) loads into an engine."""
    from sparseserve.calibration import cli as calibrate

    model = hf_models["qwen3-qknorm-d128"][0]
    parser = argparse.ArgumentParser()
    calibrate.add_cli_args(parser)
    out = tmp_path / "prefill.json"
    res = calibrate.main(
        parser.parse_args(
            [
                str(model),
                "--prefill",
                "--random-prompts",
                "--lengths",
                "400",
                "--num-samples",
                "1",
                "--out",
                str(out),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--block-size",
                "16",
                "--error-bound",
                "0.05",
                "--start-threshold",
                "0.5",
                "--min-threshold",
                "0.01",
            ]
        )
    )
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res)) and "2 layers x 4 query heads" in capsys.readouterr().out
    thr = load_prefill_thresholds(str(out), 2, 4)
    allowed = {0.0} | {0.5 / 2**k for k in range(6)}
    assert set(thr.flatten().tolist()) <= allowed
    assert 0 < data["tile_fraction"] <= 1 and data["num_q_heads"] == 4 and data["error_bound"] == 0.05
    outs, stats, _ = run(model, sparse_prefill="sale", sparse_prefill_calibration=str(out), sparse_prefill_min_len=0)
    assert all(len(o) == GREEDY.max_tokens for o in outs) and stats.prefill_tiles_dense > 0


@gpu_only
def test_gpu_engine_sparse_prefill(hf_models):
    """On the GPU (Triton kernels, CUDA graphs for decode), float32: threshold 0 gives dense prefill's tokens with
    and without KV offload, a threshold computes fewer tiles and the run completes."""
    common = dict(COMMON, device="cuda", kv_cache_memory=256 << 20)
    model = hf_models["qwen2-gqa-bias"][0]
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (500, 333, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def go(**kw):
        llm = LLM(str(model), **common, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        return outs, llm.llm_engine.get_stats(sync=True)

    dense, _ = go()
    sale, stats = go(**SALE0)
    assert sale == dense and stats.prefill_tiles_computed == stats.prefill_tiles_dense > 0
    sparse = dict(sparse_policy="topk", sparse_budget=1024, sparse_dense_layers=0, sparse_dense_context=0)
    offload, stats = go(**SALE0, **sparse, kv_offload=True)
    assert offload == dense and stats.prefill_tiles_dense > 0
    cut, stats = go(sparse_prefill="sale", sparse_prefill_threshold=1.0, sparse_prefill_min_len=0)
    assert [len(o) for o in cut] == [len(o) for o in dense]  # (the 500-token prompt's output is cut by the context)
    assert 0 < stats.prefill_tiles_computed < stats.prefill_tiles_dense
