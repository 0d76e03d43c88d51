"""`python -m benchmarks.offload --real MODEL`: KV offload against all KV in HBM on real prompts, side by side
per batch size; a CPU smoke run on a tiny model (its numbers matter on the GPU only)."""

from __future__ import annotations

import json
import pstats
import statistics

import pytest

from benchmarks import offload


@pytest.mark.parametrize("scheduling, repeats", [("sync", 2), ("async", 1)])
def test_real_mode_smoke(tiny_model_dir, tmp_path, capsys, scheduling, repeats):
    """Both engines alive and stepped in turn (one step at a time; async scheduling: blocks of steps); repeats:
    each number the median over the pairs."""
    from sparseserve.workloads.datasets import data_dir

    if not (data_dir() / "haystack").is_dir():
        pytest.skip("essay haystack (../shared/data/haystack) not found")
    out = tmp_path / "real.json"
    offload.main(
        [
            "--real",
            str(tiny_model_dir),
            "--batches",
            "1,3",
            "--prompt-len",
            "400",
            "--output-len",
            "6",
            "--margins",
            "--budget",
            "192",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--engine-arg",
            "sparse_dense_layers=0",
            "--json",
            str(out),
            "--engine-arg",
            f"async_scheduling={scheduling == 'async'}",
            "--repeats",
            str(repeats),
            "--host-profile",
            str(tmp_path / "prof"),
        ]
    )
    printed = capsys.readouterr().out
    assert "KV offload" in printed and "offload, batch 3: host time a decode step under cProfile" in printed
    rows = json.loads(out.read_text())["real"]
    assert [(r["batch"], "offload" in r["config"]) for r in rows] == [(1, False), (1, True), (3, False), (3, True)]
    for base, off in zip(rows[::2], rows[1::2]):
        assert off["same_tokens"] is True and "divergence" not in off  # offload never changes a token
        assert 0.0 <= off["hbm_hit_ratio"] <= 1.0 and off["blocks_loaded"] > 0
        assert off["blocks_filled"] == 0  # chunked prefill here: no layer-segmented prompt fills the pool
        assert off["uva_GB"] >= 0 and off["h2d_GB"] > 0  # topk: only bypass reads go over UVA
        assert off["tpot_ms"] > 0 and base["tpot_ms"] > 0 and off["tpot_vs_hbm"] > 0
        assert 0 < base["tpot_median_ms"]
        if repeats == 1:  # (with repeats: the median of the repeats' ratios, below)
            assert off["median_vs_hbm"] == off["tpot_median_ms"] / base["tpot_median_ms"]
        assert base["decode_steps"] > 0 and base["preemptions"] == 0
        assert base["graph_median_ms"] is None and "graph_vs_hbm" not in off  # GPU time: CUDA graphs only
        # topk at 192 tokens (6 blocks of 32) of a 400-token context: the policy really was sparse on both sides.
        assert 0 < base["tokens_attended"] <= 192 and 0 < off["tokens_attended"] <= 192
        # The host profiles: decode steps only (the steps after one in which every request decoded).
        assert 0 < off["host_profile_steps"] < off["output_len"] and "_host_profile" not in off
        for name, row in (("hbm", base), ("offload", off)):
            stats = pstats.Stats(str(tmp_path / "prof" / f"host_{name}_b{row['batch']}_r0.prof"))
            scheduled = [
                v for (file, _, func), v in stats.stats.items() if file.endswith("scheduler.py") and func == "schedule"
            ]
            assert scheduled and scheduled[0][1] == row["host_profile_steps"]  # one schedule a profiled step
        if repeats > 1:
            assert len(base["repeats"]) == len(off["repeats"]) == repeats
            assert off["median_vs_hbm"] == statistics.median(r["median_vs_hbm"] for r in off["repeats"])
            assert base["tpot_ms"] == statistics.median(r["tpot_ms"] for r in base["repeats"])
            assert base["batch"] == base["repeats"][0]["batch"] and isinstance(base["batch"], int)
        else:
            assert "repeats" not in base


def test_divergence_names_where_runs_part_and_the_margin_there():
    base = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7], [8, 9, 1]]  # equal; parts at 1; one token longer
    margins = [[0.5, 0.5, 0.5, 0.5], [2.0, 0.01, 3.0], [1.0, 1.0]]
    d = offload.divergence(base, margins, other)
    assert d == {"requests_differing": 2, "first_difference_at": [1, 2], "margin_at_difference": [0.01]}
    assert offload.divergence(base, None, base) == {
        "requests_differing": 0,
        "first_difference_at": [],
        "margin_at_difference": None,
    }


def test_real_run_keeps_each_tokens_top2_margin(tiny_model_dir):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(2)]
    run = offload.real_run(
        str(tiny_model_dir), prompts, 5, False, 192, device="cpu", dtype="float32", margins=True, sparse_dense_layers=0
    )
    assert [len(m) for m in run["_margins"]] == [5, 5]  # one per output token
    assert all(m >= 0 for ms in run["_margins"] for m in ms)


def test_real_mode_runs_a_topp_policy_and_counts_its_pcie_bytes(tiny_model_dir, tmp_path):
    """--policy: topp with blocks of 16 on both sides; the offload row's PCIe bytes per output token are FlashH2D's
    loads plus the UVA reads, and their share of the attended KV is that over the attended bytes."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(400)] for i in range(2)]
    policy = dict(sparse_policy="topp", sparse_budget=192, sparse_top_p=0.9, block_size=16, logical_page_size=8)
    base, off = offload.real_pair(
        str(tiny_model_dir), prompts, 6, device="cpu", dtype="float32", sparse_dense_layers=0, **policy
    )
    assert base["config"] == "topp 192, p=0.9, blocks=16, pages=8, all KV in HBM"
    assert off["config"] == "topp 192, p=0.9, blocks=16, pages=8 + KV offload"
    assert base["_tokens"] == off["_tokens"]  # offload never changes a token, under topp either
    # topp attends at most its cap: the engine's selection counters, the same on both sides
    assert 0 < off["tokens_attended"] <= 192 and off["tokens_attended"] == base["tokens_attended"]
    assert off["attended_KB_per_token"] == base["attended_KB_per_token"] > 0
    tokens = 2 * 6
    pcie = (off["h2d_GB"] + off["uva_GB"]) * 1e9 / tokens / 1e3
    assert off["pcie_KB_per_token"] == pytest.approx(pcie) and off["pcie_KB_per_token"] > 0
    assert off["pcie_of_attended"] == pytest.approx(off["pcie_KB_per_token"] / off["attended_KB_per_token"])
    assert off["prune_key_reads"] >= 0 and off["hold_backs"] >= 0 and "pcie_KB_per_token" not in base


def test_a_policy_without_a_budget_runs_its_own(tiny_model_dir):
    """--policy topp without --budget: topp's own cap (4096), not --real's topk 1024; --budget or the spec's
    budget where given."""
    assert offload.real_policy(None, None, []) == {"sparse_policy": "topk", "sparse_budget": 1024}
    assert offload.real_policy("topp", None, []) == {"sparse_policy": "topp"}
    assert offload.real_policy("topp", 2048, [])["sparse_budget"] == 2048
    assert offload.real_policy("topp:sparse_budget=512", 2048, [])["sparse_budget"] == 512
    assert offload.real_policy(None, None, ["sparse_budget=256"])["sparse_budget"] == 256
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(2)]
    run = offload.RealRun(
        str(tiny_model_dir), prompts, 2, False, None, device="cpu", dtype="float32", sparse_policy="topp"
    )
    assert run.engine.config.sparse_config.sparse_budget == 4096 and run.label == "topp 4096"


def test_offload_args_reach_the_offload_engine_alone(tiny_model_dir):
    """--offload-arg: engine arguments of the offload side only (the HBM engine would refuse them), named in its
    row's config."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(2)]
    kw = dict(device="cpu", dtype="float32", sparse_dense_layers=0, offload_engine_args={"hbm_cache_blocks": 96})
    hbm = offload.RealRun(str(tiny_model_dir), prompts, 2, False, 192, **kw)
    off = offload.RealRun(str(tiny_model_dir), prompts, 2, True, 192, **kw)
    assert off.engine.config.offload_config.hbm_cache_blocks == 96 and off.engine.config.offload_config.kv_offload
    assert hbm.engine.config.offload_config.hbm_cache_blocks is None
    assert not hbm.engine.config.offload_config.kv_offload
    for run in (hbm, off):  # both sides synchronous unless asked (each step is timed)
        assert run.engine.config.scheduler_config.async_scheduling is False and not run.engine.async_scheduling
    while not off.done:
        off.step()
    assert off.result()["config"] == "topk 192 + KV offload, hbm_cache_blocks=96"


def test_gpu_profile_takes_warm_decode_steps_out_of_tpot(tiny_model_dir):
    """--gpu-profile: each engine profiles that many full-batch decode steps after 12 warm ones; those steps are
    not in its TPOT (decode_steps), and a run with fewer steps than that profiles none."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(2)]
    kw = dict(device="cpu", dtype="float32", sparse_dense_layers=0, gpu_profile=3)
    plain = offload.real_run(
        str(tiny_model_dir), prompts, 20, True, 192, device="cpu", dtype="float32", sparse_dense_layers=0
    )
    base, off = offload.real_pair(str(tiny_model_dir), prompts, 20, 192, **kw)
    for row in (base, off):
        assert row["gpu_profile"]["steps"] == 3 and row["gpu_profile"]["gpu_busy_ms"] >= 0
        assert row["decode_steps"] == plain["decode_steps"] - 3  # the profiled steps are left out
    short = offload.real_run(str(tiny_model_dir), prompts, 6, True, 192, **kw)
    assert short["gpu_profile"] is None


def test_kernel_diff_table_puts_the_largest_differences_first():
    hbm = {"gpu_busy_ms": 1.0, "kernel_us": {"gemm": 500.0, "prune": 100.0, "lse": 70.0}}
    off = {"gpu_busy_ms": 1.2, "kernel_us": {"gemm": 490.0, "prune": 130.0, "lse": 70.0, "flash_h2d": 50.0}}
    rows = offload.kernel_diff_table(hbm, off, top=3)
    assert [r["kernel"] for r in rows] == ["(GPU busy)", "flash_h2d", "prune", "gemm"]
    assert rows[0]["diff_us"] == pytest.approx(200.0) and rows[1]["hbm_us"] == 0.0 and rows[3]["diff_us"] == -10.0


def test_layer_table_shows_the_dense_layers_the_first_sparse_one_and_the_rest():
    hbm = {"layer_us": [40.0, 45.0, 50.0, 50.0, 52.0]}
    off = {"layer_us": [60.0, 70.0, 51.0, 53.0, 55.0], "dense_layers": 2}
    rows = offload.layer_table(hbm, off)
    assert [r["layers"] for r in rows] == ["layer 0", "layer 1", "layer 2", "layers 3-4, mean"]
    assert rows[1]["diff_us"] == 25.0 and rows[3]["hbm_us"] == 51.0 and rows[3]["diff_us"] == 3.0
    assert offload.layer_table(hbm, {"layer_us": None}) == []


def test_policy_label_names_the_selection():
    assert offload.policy_label({"sparse_policy": "topk", "sparse_budget": 2048}) == "topk 2048"
    spec = dict(sparse_policy="topp", sparse_budget=4096, sparse_top_p=0.95, block_size=16)
    assert offload.policy_label(spec) == "topp 4096, p=0.95, blocks=16"
