"""The decode-time breakdown (benchmarks/decode_time.py): its split on a hand-built timeline, the async attribution of a
step's tokens (and prompt work) to the schedule launched one call earlier, each prompt's prefill time,
and a CPU smoke run whose parts add up to the TPOT of the token times."""

from __future__ import annotations

import gzip
import json
import statistics
from types import SimpleNamespace

import pytest

from benchmarks import decode_time as D
from sparseserve.workloads.datasets import data_dir

TRACE = data_dir() / "traces" / "mooncake_conversation.jsonl"


def _step(t, duration, prompt_tokens=0, segments=0, requests=(), decodes=1, work=()):
    return D.StepRecord(t, duration, decodes, prompt_tokens, segments, frozenset(requests), prompt_work=tuple(work))


def test_split_of_a_hand_built_timeline():
    steps = [
        _step(0.010, 0.010, prompt_tokens=100, requests=["a"]),  # a's first token (its prefill)
        _step(0.020, 0.010, requests=["a", "b"]),  # decode only: 10 ms
        _step(0.025, 0.005, prompt_tokens=64),  # a waits: 5 ms
        _step(0.045, 0.020, segments=1, requests=["a", "b"]),  # with a prefill segment: 20 ms
        _step(0.050, 0.005, requests=["b"]),
    ]  # b only
    out = D.decompose(steps)
    # a: intervals 1 (10 ms decode) and 3 (5 ms waiting + 20 ms with prefill) over 2 tokens;
    # b: intervals 3 (5 + 20) and 4 (5 ms decode) over 2
    assert out["requests_decoded"] == 2
    assert out["decode_ms"] == pytest.approx((10 / 2 + 5 / 2) / 2)
    assert out["waiting_ms"] == pytest.approx((5 / 2 + 5 / 2) / 2)
    assert out["waiting_mid_answer_ms"] == pytest.approx((5 / 2 + 0) / 2)  # a's after its 2nd token; b's its 1st gap
    assert out["with_prefill_ms"] == pytest.approx((20 / 2 + 20 / 2) / 2)
    assert out["tpot_ms"] == pytest.approx(((45 - 10) / 2 + (50 - 20) / 2) / 2)
    assert out["decode_steps"] == 2 and out["prefill_steps"] == 2
    assert out["decode_stalls"] == 0 and out["decode_stall_s"] == 0


def test_stalls_are_decode_steps_far_over_the_median():
    steps = [_step(0.01 * i, 0.010, requests=["a"]) for i in range(1, 6)]
    steps.append(_step(0.3, 0.450, requests=["a"]))  # 45x the median: a stall
    steps.append(_step(0.4, 0.250, requests=["a"]))  # 25x: not one
    steps.append(_step(0.9, 0.500, segments=1, requests=["a"]))  # with a prefill: never one
    out = D.decompose(steps)
    assert out["decode_stalls"] == 1 and out["decode_stall_s"] == pytest.approx(0.450)


def _seq(request_id):
    return SimpleNamespace(request_id=request_id)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_are_booked_to_the_step_that_produced_them(async_scheduling):
    prefill = SimpleNamespace(scheduled=[(_seq("p"), 300), (_seq("r"), 1)], segments=[])
    decode = SimpleNamespace(scheduled=[(_seq("r"), 1), (_seq("p"), 1)], segments=[])
    timeline = D.Timeline(async_scheduling)
    out = [SimpleNamespace(request_id="r", outputs=[SimpleNamespace(token_ids=[7])])]
    segment = SimpleNamespace(scheduled=[(_seq("r"), 1)], segments=[SimpleNamespace(seq=_seq("q"), cost=50)])
    calls = ((1.0, prefill, [], 0.5), (2.0, decode, out, 0.0), (3.0, decode, out, 0.0), (4.0, segment, out, 0.0))
    for t, sched, outputs, idle in calls:
        timeline.on_schedule(sched)  # the engine calls it before the step runs
        timeline(outputs if async_scheduling else out, t, idle)
    first, second, third = timeline.steps[1:]
    # async: the call at t=2 lands the prefill step launched at t=1; sync: each call lands its own
    assert first.prefills == async_scheduling and first.prompt_tokens == (300 if async_scheduling else 0)
    assert not second.prefills and second.decodes == 2 and second.duration == pytest.approx(1.0)
    assert timeline.steps[0].duration == pytest.approx(0.5)  # the replay's sleep before the first step left out
    # the call at t=4 launched a segment: async, it lands a decode step but waited on that launch (a prefill's time)
    assert third.segments == (0 if async_scheduling else 1) and third.prefills
    assert third.launches_prefill == async_scheduling and D.decompose(timeline.steps)["prefill_steps"] == 2
    # prompt work: sync, each call's own; async, the landed step's, plus the launched one's where the launch blocked
    zeroth = timeline.steps[0]
    if async_scheduling:
        assert [s.prompt_work for s in timeline.steps] == [(("p", 300),), (("p", 300),), (), (("q", 50),)]
    else:
        assert [s.prompt_work for s in timeline.steps] == [(("p", 300),), (), (), (("q", 50),)]
    assert zeroth.prompt_tokens == (0 if async_scheduling else 300)


def test_prefill_booked_by_prompt():
    steps = [
        _step(0.1, 0.100, work=[("a", 1000)]),
        _step(0.2, 0.060, work=[("a", 1000), ("b", 2000)]),  # 20 ms to a, 40 to b
        _step(0.3, 0.010),  # decode only: nobody's prefill
        _step(0.4, 0.050, work=[("c", 4000)]),
    ]
    per = D.prefill_by_prompt(steps)
    assert per.keys() == {"a", "b", "c"}
    assert per["a"][0] == 2000 and per["a"][1] == pytest.approx(0.120)
    assert per["b"] == (2000, pytest.approx(0.040)) and per["c"] == (4000, pytest.approx(0.050))


@pytest.mark.skipif(not TRACE.exists(), reason=f"Mooncake trace not found at {TRACE} (../shared/data)")
def test_decode_time_smoke(tiny_model_dir, tmp_path):
    out = tmp_path / "decode_time.json"
    report = D.main(
        [
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--num-gpu-blocks",
            "64",
            "--num-requests",
            "5",
            "--time-scale",
            "0",
            "--max-input-len",
            "300",
            "--max-output-len",
            "12",
            "--configs",
            "dense",
            "layerseg_async",
            "--engine-arg",
            "block_size=16",
            "--engine-arg",
            "sparse_budget=128",
            "--engine-arg",
            "sparse_dense_layers=1",
            "--json",
            str(out),
            "--profile-window",
            "3",
            "4",
            "--profile-trace",
            str(tmp_path),
            "--no-profile-stack",
        ]
    )
    for name in ("dense", "layerseg_async"):  # the window's Chrome trace, gzipped: torch's ops, no Python frames
        with gzip.open(tmp_path / f"{name}.trace.json.gz") as f:
            cats = {e.get("cat") for e in json.load(f)["traceEvents"]}
        assert "cpu_op" in cats and "python_function" not in cats
    assert json.loads(out.read_text())["rows"] == report["rows"]
    for row in report["rows"]:  # the window's torch profile (CPU: no GPU timeline)
        assert set(row["profile"]) >= {"gpu_busy_ms", "critical_path_ms_by_kind", "blocking_host_calls"}
        # every request's prompt booked (chunked or layer by layer), with time
        requests = {r for s in report["timelines"][row["config"]] for r in s["requests"]}
        assert row["prefill_by_prompt"].keys() == requests and len(requests) == 5
        assert all(n > 0 and sec > 0 for n, sec in row["prefill_by_prompt"].values())
    assert [r["config"] for r in report["rows"]] == ["dense", "layerseg_async"]
    for row in report["rows"]:
        # the parts add up to the TPOT of the token times themselves
        times: dict[str, list[float]] = {}
        for s in report["timelines"][row["config"]]:
            for r in s["requests"]:
                times.setdefault(r, []).append(s["t"])
        tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
        assert row["requests_decoded"] == len(tpots) == 5
        assert row["tpot_ms"] == pytest.approx(1e3 * statistics.fmean(tpots))
        assert row["decode_ms"] + row["with_prefill_ms"] + row["waiting_ms"] == pytest.approx(row["tpot_ms"])
        assert row["decode_steps"] > 0 and row["output_tok_s"] > 0
    assert "hbm_hit" in report["rows"][1]
    dense, seg = report["rows"]
    # what the lists attended: within topk's budget of 128 tokens, none flat or held (topp's counters)
    assert "tokens_per_list" not in dense and 0 < seg["tokens_per_list"] <= 128
    assert seg["flat_share"] == seg["held_share"] == seg["flat_steps"] == 0
    ratios = {r["config"]: r for r in report["against_dense"]}  # the ratios, against dense of this call
    assert ratios["dense"] == {"config": "dense", "x_tok_s": 1.0, "ttft_x_lower": 1.0, "x_tpot": 1.0}
    assert ratios["layerseg_async"]["x_tok_s"] == pytest.approx(seg["output_tok_s"] / dense["output_tok_s"])
    assert ratios["layerseg_async"]["ttft_x_lower"] == pytest.approx(dense["mean_ttft_s"] / seg["mean_ttft_s"])
    assert ratios["layerseg_async"]["x_tpot"] == pytest.approx(seg["tpot_ms"] / dense["tpot_ms"])
    assert D.against(report["rows"][1:]) == []  # no dense in the call: no ratios


def test_a_cut_off_run_keeps_the_configs_that_finished(tiny_model_dir, tmp_path, monkeypatch, filler_haystack):
    """The JSON is written after each config: a call stopped by a time limit in its second config still has the
    first's row (a device call's results come back only from files). The LongBench mix over filler text: no data
    folder needed."""
    out, real = tmp_path / "cut.json", D.run_config

    def second_config_stops(model, name, *a, **kw):
        if name != "dense":
            raise TimeoutError("the call's time limit")
        return real(model, name, *a, **kw)

    monkeypatch.setattr(D, "run_config", second_config_stops)
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-gpu-blocks", "64", "--num-requests", "2"]
    args += ["--dataset", "longbench", "--max-input-len", "200", "--output-len", "4", "--json", str(out)]
    with pytest.raises(TimeoutError):
        D.main(args + ["--configs", "dense", "sparse", "--engine-arg", "block_size=16"])
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["rows"]] == ["dense"] and report["rows"][0]["requests_decoded"] == 2
    assert report["against_dense"][0]["x_tok_s"] == 1.0 and list(report["timelines"]) == ["dense"]


def test_fresh_process_runs_each_config_apart(tiny_model_dir, tmp_path, monkeypatch, filler_haystack):
    """--fresh-process: each config runs in a child process of its own (the parent runs none), and makes the same
    schedule as in one process; the report and its ratios are built as in one process."""
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-gpu-blocks", "64", "--num-requests", "3"]
    args += ["--dataset", "longbench", "--max-input-len", "200", "--output-len", "4", "--engine-arg", "block_size=16"]
    together = D.main(args + ["--configs", "dense", "sparse"])

    def not_here(*a, **kw):
        raise AssertionError("a config ran in the parent process")

    monkeypatch.setattr(D, "run_config", not_here)
    out = tmp_path / "fresh.json"
    apart = D.main(args + ["--configs", "dense", "sparse", "--fresh-process", "--json", str(out)])
    assert [r["config"] for r in apart["rows"]] == ["dense", "sparse"]
    assert json.loads(out.read_text())["rows"] == apart["rows"]

    def schedule(report, config):
        return [(s["decodes"], s["prompt_tokens"], s["segments"], s["requests"]) for s in report["timelines"][config]]

    for c in ("dense", "sparse"):
        assert schedule(apart, c) == schedule(together, c) and len(schedule(apart, c)) > 2
    dense, sparse = apart["rows"]
    assert apart["against_dense"][1]["x_tok_s"] == pytest.approx(sparse["output_tok_s"] / dense["output_tok_s"])


@pytest.fixture
def filler_haystack(tmp_path, monkeypatch):
    """A haystack of the built-in filler sentences (a clone without ../shared/data has no essays)."""
    from sparseserve.workloads.datasets import haystack_corpus
    from sparseserve.workloads.tasks import builtin_filler

    (tmp_path / "haystack").mkdir()
    (tmp_path / "haystack" / "filler.txt").write_text(" ".join(builtin_filler(400)))
    monkeypatch.setenv("SPARSESERVE_DATA_DIR", str(tmp_path))
    haystack_corpus.cache_clear()
    yield
    haystack_corpus.cache_clear()


def test_longbench_replay_jobs(tiny_model_dir, filler_haystack):
    """The LongBench mix replayed in-process: `bench serve --dataset longbench`'s lengths (capped), every request
    asking for --output-len tokens, Poisson arrivals at --request-rate (all at once by default)."""
    import argparse

    from transformers import AutoTokenizer

    from benchmarks.common import add_replay_args, add_workload_args, max_output_len, workload_jobs
    from sparseserve.workloads import longbench

    p = argparse.ArgumentParser()
    add_replay_args(p)
    add_workload_args(p)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = p.parse_args(["--dataset", "longbench", "--num-requests", "6", "--max-input-len", "400"])
    args.output_len = 7
    jobs = workload_jobs(tok, args)
    want = longbench.sample_requests(6, 0, "llama3", 400, "max", 7)
    assert [j.max_tokens for j in jobs] == [7] * 6 and max_output_len(args) == 7
    assert all(j.arrival_s == 0 for j in jobs)
    for j, r in zip(jobs, want):  # the prompt builder's length within a few tokens of the drawn one (BOS, joins)
        assert abs(len(j.prompt_token_ids) - r.prompt_len) <= 8
    args = p.parse_args(["--dataset", "longbench", "--num-requests", "6", "--request-rate", "2"])
    assert max_output_len(args) == max(d.max_gen for d in longbench.DATASETS)
    arrivals = [j.arrival_s for j in workload_jobs(tok, args)]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_config_specs():
    """A config may carry engine arguments of its own, over --engine-arg's, over the config's; a name that is no
    config is refused by the parser."""
    got = D.config_kwargs("kvoffload_async:segment_decode_steps=1,sparse_budget=1024", {"sparse_budget": 512, "a": 1})
    assert got == D.CONFIGS["kvoffload_async"] | {"a": 1, "sparse_budget": 1024, "segment_decode_steps": 1}
    assert D.config_kwargs("dense", {"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="'densest' is none of"):
        D.config_kwargs("densest:a=1", {})
    with pytest.raises(SystemExit):
        D.main(["--configs", "dense", "nope"])


def test_gauges_show_where_the_budget_sits(tiny_model_dir, filler_haystack):
    """--gauges-every N: the engine's gauges every N steps (a used part never above its size); the row holds each
    used part's maximum and the working sets' mean share of their limit while requests waited."""
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-gpu-blocks", "64", "--num-requests", "5"]
    args += ["--dataset", "longbench", "--max-input-len", "200", "--output-len", "6", "--gauges-every", "2"]
    for kv in ("block_size=16", "sparse_budget=128", "sparse_dense_layers=1", "max_num_seqs=2"):
        args += ["--engine-arg", kv]
    report = D.main(args + ["--configs", "kvoffload_async"])
    row = report["rows"][0]
    samples = row["gauges"]
    assert [s["step"] for s in samples] == [
        2 * (i + 1) for i in range(len(report["timelines"]["kvoffload_async"]) // 2)
    ]
    for s in samples:
        assert set(s) == {"step", "t", *D.GAUGES}
        assert 0 <= s["offload_device_rows_used"] <= s["offload_device_rows"]
        assert 0 <= s["offload_device_blocks_used"] <= s["offload_device_blocks"]
        assert s["num_running"] <= 2 and s["working_set_limit"] > 0
    assert row["offload_device_rows_used_max"] == max(s["offload_device_rows_used"] for s in samples) > 0
    held = [s["working_set_blocks"] / s["working_set_limit"] for s in samples if s["num_waiting"]]
    assert held and row["working_set_share_while_waiting"] == pytest.approx(statistics.fmean(held))
    with pytest.raises(SystemExit):
        D.main(args[:-2] + ["--gauges-every", "-1", "--configs", "dense"])
