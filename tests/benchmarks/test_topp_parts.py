"""benchmarks/topp_parts.py runs on the CPU (the kernels under the Triton interpreter, float32, a tiny context,
each stage called once instead of timed; bf16 on a GPU): its numbers matter on the GPU only."""

from __future__ import annotations

import torch

from benchmarks import topp_parts as bench


def launch_dtype() -> tuple[str, torch.dtype, float]:
    """The launch variants' tests run in the benchmark's bf16 on a GPU (some tiles of float32 exceed its shared
    memory), float32 under the interpreter; and the tolerance between two variants' results."""
    return ("cuda", torch.bfloat16, 2e-2) if torch.cuda.is_available() else ("cpu", torch.float32, 1e-4)


def test_stages_run_in_the_engine_order():
    device, dtype, _ = launch_dtype()
    specs = ["topk:sparse_budget=256", "topp:sparse_budget=256,sparse_top_p=0.9,logical_page_size=16"]
    rows = bench.measure(specs, [1024], 2, timer=lambda call: (call(), 0.0)[1], device=device, dtype=dtype)
    assert not [r for r in rows if "error" in r]
    got = [(r["policy"].split(":")[0], r["stage"], r["variant"]) for r in rows]
    score = [r["variant"] for r in rows if r["stage"] == "score"]
    assert len(score) == 2 * len(bench.SCORE_CONFIGS) and score[0] == "rows=128,warps=4,stages=2,tiles=2"
    attention = [r["variant"] for r in rows if r["stage"] == "attention"]
    assert attention == 2 * [name for name, _ in bench.ATTENTION_CONFIGS] and attention[0] == "default"
    got = [g for g in got if g[1] not in ("score", "attention")]
    topp = [("topp", "select", "default")]
    topp += [("topp", "block lse", f"tile_n={t}") for t in bench.LSE_TILES]
    topp += [("topp", "block lse", "flat lists skipped")]  # as the engine runs flagged lists
    topp += [("topp", "prune", v) for v in ("sort", "ways=4", "ways=8", "ways=16", "flat lists skipped")]
    assert got == [("topk", "select", "default")] + topp


def test_prune_variants_agree():
    """Every search keeps the same lists (the bit-pattern rounds are exact, as the sort): the variants time one
    result."""
    device, dtype, _ = launch_dtype()
    spec = "topp:sparse_budget=256,sparse_top_p=0.5,sparse_topp_flat_share=1.0,block_size=32"  # flat: prune all
    stages, lists = bench.layer_stages(spec, 1024, 2, device, dtype)
    results = []
    for stage, _, call in stages:
        lists.fill_(-2)
        call()
        if stage == "prune":
            results.append(lists.clone())
    assert len(results) == len(bench.PRUNE_SEARCHES) and all(torch.equal(results[0], r) for r in results)
    assert (results[0] >= 0).any() and ((results[0] >= 0).sum(-1) < 256 // 32).any()  # something pruned


def test_score_variants_agree():
    """Every scoring launch variant computes the same block scores: the variants time one result."""
    device, dtype, tol = launch_dtype()
    stages, _ = bench.layer_stages("topk:sparse_budget=256", 1024, 2, device, dtype)
    scores = [call() for stage, _, call in stages if stage == "score"]
    assert len(scores) == len(bench.SCORE_CONFIGS) and torch.isfinite(scores[0]).all()
    assert all(torch.allclose(scores[0], s, rtol=tol, atol=tol) for s in scores[1:])


def test_attention_variants_agree():
    """Every attention launch variant computes the same output over the same lists (blocks of 16, so the plain
    kernel's tiles span several blocks)."""
    device, dtype, tol = launch_dtype()
    spec = "topp:sparse_budget=256,sparse_top_p=0.9,block_size=16,logical_page_size=16"
    stages, _ = bench.layer_stages(spec, 1024, 2, device, dtype)
    outs = [call() for stage, _, call in stages if stage in ("score", "select", "block lse", "prune", "attention")]
    outs = outs[-len(bench.ATTENTION_CONFIGS) :]
    assert len(outs) == len(bench.ATTENTION_CONFIGS) and torch.isfinite(outs[0]).all()
    assert all(torch.allclose(outs[0].float(), o.float(), rtol=tol, atol=tol) for o in outs[1:])
