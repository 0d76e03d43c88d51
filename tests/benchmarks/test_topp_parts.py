"""benchmarks/topp_parts.py runs on the CPU (the kernels under the Triton interpreter, float32, a tiny context,
each stage called once instead of timed): its numbers matter on the GPU only."""

from __future__ import annotations

import torch

from benchmarks import topp_parts as bench


def test_stages_run_in_the_engine_order():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = ["topk:sparse_budget=256", "topp:sparse_budget=256,sparse_top_p=0.9,logical_page_size=16"]
    rows = bench.measure(specs, [1024], 2, timer=lambda call: (call(), 0.0)[1], device=device, dtype=torch.float32)
    assert not [r for r in rows if "error" in r]
    got = [(r["policy"].split(":")[0], r["stage"], r["variant"]) for r in rows]
    score = [r["variant"] for r in rows if r["stage"] == "score"]
    assert len(score) == 2 * len(bench.SCORE_CONFIGS) and score[0] == "rows=128,warps=4,stages=2,tiles=2"
    got = [g for g in got if g[1] != "score"]
    topp = [("topp", "select", "default")]
    topp += [("topp", "block lse", f"tile_n={t}") for t in bench.LSE_TILES]
    topp += [("topp", "prune", v) for v in ("sort", "ways=4", "ways=8", "ways=16")]
    assert got == [("topk", "select", "default"), ("topk", "attention", "default")] + topp + [
        ("topp", "attention", "default")
    ]


def test_prune_variants_agree():
    """Every search keeps the same lists (the bit-pattern rounds are exact, as the sort): the variants time one
    result."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stages, lists = bench.layer_stages("topp:sparse_budget=256,sparse_top_p=0.5", 1024, 2, device, torch.float32)
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stages, _ = bench.layer_stages("topk:sparse_budget=256", 1024, 2, device, torch.float32)
    scores = [call() for stage, _, call in stages if stage == "score"]
    assert len(scores) == len(bench.SCORE_CONFIGS) and torch.isfinite(scores[0]).all()
    assert all(torch.allclose(scores[0], s, rtol=1e-5, atol=1e-5) for s in scores[1:])
