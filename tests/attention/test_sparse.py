"""Sparse decode on the CPU through the public API: config and flags, the selection reference, the
engine (sparse path with a covering budget == dense, token for token; small budgets run, attend less
and free every block), streaming heads and their calibration, stats and /metrics."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.attention.selection import SelectionParams, SelectionState
from sparseserve.bench.attention_probe import AttentionProbe
from sparseserve.config import EngineConfig
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kernels.block_score import select_ref
from sparseserve.kernels.topp_prune import prune_ref
from sparseserve.metrics import ServerMetrics, parse_metrics

BS = 8  # small blocks: the tiny prompts span many of them
COMMON = dict(device="cpu", block_size=BS, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (120, 75, 30)]


def run(model_dir, probe: bool = False, **kw) -> tuple[list[list[int]], LLM, dict | None]:
    llm = LLM(str(model_dir), **COMMON, **kw)
    if not probe:
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)], llm, None
    with AttentionProbe(llm.llm_engine.model_runner.attn_backend) as p:
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, p.report()["layers"]


def test_config_and_flags():
    cfg = EngineConfig.from_kwargs(
        sparse_policy="topp",
        sparse_budget=4096,
        sparse_top_p=0.9,
        sparse_reuse=4,
        sparse_dense_layers=1,
        streaming_heads="h.json",
        logical_page_size=8,
    )
    assert cfg.sparse_config.sparse_top_p == 0.9 and cfg.sparse_config.enabled
    args = build_parser(["generate"]).parse_args(
        [
            "generate",
            "--sparse-policy",
            "topk",
            "--sparse-budget",
            "1024",
            "--sparse-reuse",
            "2",
            "--streaming-heads",
            "h.json",
            "--logical-page-size",
            "16",
            "--sparse-dense-layers",
            "0",
            "--sparse-lag",
            "1",
        ]
    )
    kw = engine_kwargs_from_args(args)
    assert kw["sparse_policy"] == "topk" and kw["sparse_budget"] == 1024 and kw["logical_page_size"] == 16
    assert kw["sparse_lag"] == 1
    bad = [
        dict(sparse_policy="quest"),
        dict(sparse_top_p=0.0),
        dict(sparse_topp_heads="max"),
        dict(sparse_topp_flat_share=0.0),
        dict(sparse_topp_flat_share=1.5),
        dict(sparse_topp_flat_budget=0),
        dict(sparse_topp_flat_budget=4096, sparse_budget=2048),
        dict(sparse_reuse=0),
        dict(sparse_local_blocks=0),
        dict(logical_page_size=48),
        dict(logical_page_size=64, block_size=32),
        dict(sparse_policy="topk", sparse_budget=128, block_size=32),  # 4 blocks: no room past sink + local
        dict(sparse_lag=2),
        dict(sparse_policy="topk", sparse_lag=1, sparse_reuse=2, kv_offload=True),
        dict(sparse_policy="topp", sparse_lag=1, sparse_reuse=2, kv_offload=True),
        dict(sparse_policy="topp", sparse_topp_flat_hold=-1),
        dict(sparse_policy="topk", sparse_topp_flat_hold=2),  # no flat lists
        dict(sparse_policy="topp", sparse_topp_flat_hold=2, sparse_topp_flat_share=1.0),  # none flagged
        dict(sparse_policy="topp", sparse_topp_flat_hold=2, sparse_reuse=2),
        dict(sparse_policy="topp", sparse_topp_flat_hold=2, sparse_lag=1, kv_offload=True),
        dict(sparse_policy="topp", sparse_topp_flat_hold=2, kv_offload=True),  # plain reads: the pool thrashes
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            EngineConfig.from_kwargs(**kwargs)
    # topk lags under KV offload by default; topp does not (lagged candidates lose answers), unless asked to
    assert EngineConfig.from_kwargs(sparse_policy="topk", kv_offload=True).sparse_config.sparse_lag == 1
    assert EngineConfig.from_kwargs(sparse_policy="topp", kv_offload=True).sparse_config.sparse_lag == 0
    topp_lag = EngineConfig.from_kwargs(sparse_policy="topp", kv_offload=True, sparse_lag=1)
    assert topp_lag.sparse_config.sparse_lag == 1


def _defaults(**kw) -> tuple:
    c = EngineConfig.from_kwargs(**kw)
    s = c.sparse_config
    return c.cache_config.block_size, s.sparse_budget, s.sparse_top_p, s.sparse_topp_flat_hold, s.logical_page_size


def test_policy_defaults():
    """A policy sets what the user leaves unset: topp its accurate setting (cap 4096, p 0.99, blocks of 16) with the
    hold where it can run (not lagged, no reuse, flat lists flagged) and KV offload is off; what the user gives
    stays. Dense and topk keep the engine's (blocks of 32, budget 2048)."""
    assert _defaults() == (32, 2048, 0.95, 0, None)
    assert _defaults(sparse_policy="topk") == (32, 2048, 0.95, 0, None)
    assert _defaults(sparse_policy="topp") == (16, 4096, 0.99, 4, None)
    assert _defaults(sparse_policy="topp", kv_offload=True) == (16, 4096, 0.99, 0, None)
    assert _defaults(sparse_policy="topp", kv_offload=True, offload_prefetch=True) == (16, 4096, 0.99, 0, None)
    for no_hold in (dict(sparse_lag=1), dict(sparse_reuse=2), dict(sparse_topp_flat_share=1.0)):
        assert _defaults(sparse_policy="topp", **no_hold)[3] == 0
    given = dict(block_size=32, sparse_budget=2048, sparse_top_p=0.9, sparse_topp_flat_hold=2, logical_page_size=8)
    assert _defaults(sparse_policy="topp", **given) == (32, 2048, 0.9, 2, 8)
    assert _defaults(sparse_policy="topp", kv_offload=True, offload_prefetch=True, sparse_topp_flat_hold=2)[3] == 2
    # the CLI passes every flag, unset ones as None: `--sparse-policy topp` alone gets the same setting
    args = build_parser(["generate"]).parse_args(["generate", "--sparse-policy", "topp"])
    assert _defaults(**engine_kwargs_from_args(args)) == (16, 4096, 0.99, 4, None)


def test_selection_reference():
    """topk keeps the k best masses; topp the fewest best reaching p; sink and local always."""
    p = dict(cap=4, sink=1, local=1, block_size=1)
    scores = torch.log(torch.tensor([[[0.05, 0.3, 0.02, 0.25, 0.03, 0.2, 0.15]]]))  # masses, sum 1
    lens = torch.tensor([7])
    assert sorted(select_ref(scores, lens, torch.tensor([False]), **p)[0, 0].tolist()) == [0, 1, 3, 6]
    topp = dict(p, top_p=0.45)  # sink + local hold 0.2: one more block
    assert sorted(select_ref(scores, lens, torch.tensor([False]), **topp)[0, 0].tolist()) == [-1, 0, 1, 6]
    assert sorted(select_ref(scores, lens, torch.tensor([True]), **p)[0, 0].tolist()) == [-1, -1, 0, 6]


def test_prune_reference():
    """topp's pruning: masses from the blocks' lse, softmax over the whole list (sink and local included),
    averaged over the KV group; the fewest best candidates reaching p; ties at the threshold all kept."""
    # One sequence of 10 one-token blocks, list: sink 0, local 9, candidates 3, 5, 7, then padding.
    lists = torch.tensor([[[0, 9, 3, 5, 7, -1]]], dtype=torch.int32)
    head0 = [0.5, 0.1, 0.3, 0.06, 0.04, 1.0]  # the last entry is padding: ignored
    head1 = [0.9, 0.1, 1e-9, 1e-9, 1e-9, 1.0]  # all its mass on sink + local
    lse = torch.tensor([[head0, head1]]).log()  # a one-token block's lse is its logit
    lens = torch.tensor([10])  # group mean: sink + local 0.8, then 0.15, 0.03, 0.02
    p = dict(sink=1, local=1, block_size=1)
    for top_p, kept in [
        (0.79, [0, 9]),
        (0.9, [0, 9, 3]),
        (0.96, [0, 9, 3, 5]),
        (0.99, [0, 9, 3, 5, 7]),
        (1.0, [0, 9, 3, 5, 7]),
    ]:
        got = prune_ref(lse, lists, lens, top_p=top_p, **p)[0, 0].tolist()
        assert got == kept + [-1] * (6 - len(kept)), top_p
    # Each head on its own: head 0 needs 3 and 5 to reach 0.94 (0.6 + 0.3 + 0.06), the group's mean only 3.
    assert prune_ref(lse, lists, lens, top_p=0.94, **p)[0, 0].tolist() == [0, 9, 3, -1, -1, -1]
    assert prune_ref(lse, lists, lens, top_p=0.94, per_head=True, **p)[0, 0].tolist() == [0, 9, 3, 5, -1, -1]
    tie = lse.clone()
    tie[0, 0, 3:5] = torch.tensor([0.05, 0.05]).log()
    assert prune_ref(tie, lists, lens, top_p=0.96, **p)[0, 0].tolist() == [0, 9, 3, 5, 7, -1]
    # A context that fits the cap keeps every block (all forced), whatever p.
    assert prune_ref(lse, lists, torch.tensor([6]), top_p=0.5, **p)[0, 0].tolist() == lists[0, 0].tolist()


@pytest.mark.slow
def test_flat_flags_follow_their_lists():
    """topp's flat flags live beside the lists: a state slot handed to a new sequence starts with none, and a
    paused sequence's sticky lists come back with their flags, in whatever slot it resumes in."""
    params = SelectionParams(cap=4, sink=1, local=1, reuse=1, block_size=BS, page_size=BS, stickiness=1.0)
    state = SelectionState(params, 2, 2, 2, torch.zeros(2, 2, dtype=torch.bool), torch.device("cpu"))
    (a,) = state.assign([10])
    state.sel[:, a] = torch.randint(0, 9, (2, 2, 4), dtype=torch.int32)
    state.flat[:, a] = torch.tensor([[1, 0], [0, 1]], dtype=torch.int8)
    lists, flags = state.sel[:, a].clone(), state.flat[:, a].clone()
    state.release(10, paused=True)
    (b,) = state.assign([11])  # the paused sequence's slot, handed to another
    assert b == a and (state.flat[:, b] == 0).all() and (state.sel[:, b] == -1).all()
    state.flat[:, b] = 1
    (c,) = state.assign([11, 10])[1:]
    assert c != b and torch.equal(state.sel[:, c], lists) and torch.equal(state.flat[:, c], flags)


def test_full_budget_equals_dense(hf_models):
    """Chunked prefill mixed with decodes; the sparse runs score, select and run the sparse attention
    for every decode (sparse_dense_context=0) with a budget covering every block. An untied model: its
    logits are far apart, so float32 rounding differences between the two paths cannot flip a token."""
    model_dir = hf_models["qwen2-gqa-bias"][0]
    dense, _, _ = run(model_dir)
    forced = dict(sparse_budget=1024, sparse_dense_layers=0, sparse_dense_context=0, sparse_local_blocks=2)
    topk, llm, probe = run(model_dir, probe=True, sparse_policy="topk", **forced)
    assert topk == dense
    assert all(r["mass_min"] > 1 - 1e-6 and r["rel_err_max"] < 1e-4 for r in probe.values())
    stats = llm.llm_engine.get_stats()
    assert stats.sparse_selections == 2 * 2 * 3 * (GREEDY.max_tokens - 1)  # layers x KV heads x seqs x decodes
    topp, _, _ = run(model_dir, sparse_policy="topp", sparse_top_p=1.0, **forced)
    assert topp == dense
    # sparse_lag: each step attends the list of the step before (the prefill's last token for the first decode)
    lagged, llm, _ = run(model_dir, sparse_policy="topk", sparse_lag=1, **forced)
    assert lagged == dense
    # every decode, and every prefill chunk's end (at least one a sequence)
    assert llm.llm_engine.get_stats().sparse_selections >= 2 * 2 * 3 * GREEDY.max_tokens
    # lagged topp: candidates from the step before, pruned by each decode's own query, which counts them
    lagged, llm, probe = run(model_dir, probe=True, sparse_policy="topp", sparse_top_p=1.0, sparse_lag=1, **forced)
    assert lagged == dense
    assert all(r["mass_min"] > 1 - 1e-6 for r in probe.values())
    assert llm.llm_engine.get_stats().sparse_selections == 2 * 2 * 3 * (GREEDY.max_tokens - 1)


@pytest.mark.parametrize("lag", [0, 1])
def test_stickiness_steadies_lists_and_forgets_other_sequences(tiny_model_dir, lag):
    """sparse_stickiness: lists change less from step to step than without it, and a sequence never sticks
    to the lists a state slot held for another: each prompt selects the same alone as after others ran."""
    kw = {**COMMON, **dict(sparse_policy="topk", sparse_budget=4 * BS, sparse_dense_layers=0, sparse_lag=lag)}
    kw |= dict(sparse_sink_blocks=1, sparse_local_blocks=1, max_num_seqs=1)  # one state slot, reused

    def lists_of(stickiness: float, batch: list[list[int]]) -> list[torch.Tensor]:
        """Layer 1's lists at every decode step (one sequence runs at a time)."""
        llm = LLM(str(tiny_model_dir), **kw, sparse_stickiness=stickiness)
        be = llm.llm_engine.model_runner.attn_backend
        out: list[torch.Tensor] = []

        def observe(layer, q, o, kv_cache, meta, scale) -> None:
            # the lists the decode attends (a context within the budget attends all of it, with no list)
            if layer == 1 and meta.num_decodes and meta.seq_lens[0] > 4 * BS:
                rows = be.step_rows[0] if lag else meta.backend_meta.slots
                out.append(be.state.sel[1][rows[: meta.num_decodes].long()].sort(-1).values)

        be.observers.append(observe)
        llm.generate(batch, GREEDY, use_tqdm=False)
        return out

    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (80, 120, 110)]  # short ones first
    changed = {}
    for stickiness in (0.0, 8.0):
        together = lists_of(stickiness, batch)
        alone = [x for p in batch for x in lists_of(stickiness, [p])]
        assert len(together) == len(alone) and all(torch.equal(a, b) for a, b in zip(together, alone)), stickiness
        changed[stickiness] = sum(int((a != b).any()) for a, b in zip(alone, alone[1:]))
    assert changed[8.0] < changed[0.0]


def test_small_budget(tiny_model_dir, tmp_path):
    """Budgets far below the context: decodes attend less (probe mass < 1), outputs stay well formed,
    reuse, hierarchical pages and streaming heads run, every block comes back; the counters and /metrics
    agree (topp's flat lists among them)."""
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"streaming_heads": {"1": [0]}}))
    cases = [
        dict(sparse_policy="topk", sparse_budget=4 * BS, sparse_dense_layers=0),
        dict(
            sparse_policy="topp",
            sparse_budget=6 * BS,
            sparse_top_p=0.6,
            sparse_reuse=3,
            logical_page_size=2,
            sparse_dense_layers=1,
            streaming_heads=str(heads),
        ),
    ]
    for kw in cases:
        outs, llm, probe = run(tiny_model_dir, probe=True, sparse_sink_blocks=1, sparse_local_blocks=2, **kw)
        assert all(len(o) == GREEDY.max_tokens for o in outs)
        sparse_layers = [r for layer, r in probe.items() if int(layer) >= kw["sparse_dense_layers"]]
        assert min(r["mass_min"] for r in sparse_layers) < 0.999
        engine = llm.llm_engine
        stats = engine.get_stats()
        assert stats.num_blocks_used == 0 and not engine.has_unfinished_requests()
        engine.allocator.check()
        assert 0 < stats.sparse_blocks_selected <= stats.sparse_selections * kw["sparse_budget"] // BS
        if kw["sparse_policy"] == "topp":  # the counters report the pruned lists, shorter than the candidates
            assert stats.sparse_blocks_selected < stats.sparse_selections * kw["sparse_budget"] // BS
        assert 0 <= stats.sparse_flat_lists <= stats.sparse_selections  # topk: none
        text = ServerMetrics(lambda: stats, "m").render().decode()
        got = parse_metrics(text)
        assert got["sparseserve:sparse_mean_budget_tokens"] <= kw["sparse_budget"]
        assert got["sparseserve:sparse_selections_total"] == stats.sparse_selections
        assert got["sparseserve:sparse_flat_lists_total"] == stats.sparse_flat_lists
        assert got["sparseserve:sparse_flat_list_share"] == stats.sparse_flat_lists / stats.sparse_selections


def test_flat_hold_keeps_flat_lists(tiny_model_dir):
    """sparse_topp_flat_hold: on random weights (flat masses: lists flagged) a flat list is kept for the next
    H steps of its (sequence, layer, KV head) instead of selected, so fewer lists are flagged and the held ones are
    counted apart (/metrics too), while the selection counters count every list a decode attends, held or not;
    a hold longer than the run selects each list once a decode. Outputs stay well formed, every block comes back."""
    base = dict(sparse_policy="topp", sparse_budget=6 * BS, sparse_top_p=0.7, sparse_dense_layers=1)
    base |= dict(sparse_dense_context=0, sparse_topp_flat_share=0.5)
    counts = {}
    for hold in (0, 2, 100):
        outs, llm, _ = run(tiny_model_dir, sparse_topp_flat_hold=hold, **base)
        assert all(len(o) == GREEDY.max_tokens for o in outs)
        engine = llm.llm_engine
        stats = engine.get_stats()
        assert stats.num_blocks_used == 0 and not engine.has_unfinished_requests()
        engine.allocator.check()
        counts[hold] = (stats.sparse_flat_lists, stats.sparse_held_lists, stats.sparse_selections)
        got = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
        assert got["sparseserve:sparse_held_lists_total"] == stats.sparse_held_lists
    assert counts[0][0] > 0 and counts[0][1] == 0  # flagged, none held
    assert counts[2][1] > 0 and counts[2][0] < counts[0][0] and counts[2][2] == counts[0][2] == counts[100][2]
    # held 100 steps: each (decode sequence, layer, KV head) flags at most once after its prompt
    assert counts[100][1] > counts[2][1] and counts[100][0] < counts[2][0]


def test_calibrate_streaming_heads(tiny_model_dir, tmp_path):
    from sparseserve.calibration import cli as calibrate

    p = argparse.ArgumentParser()
    calibrate.add_cli_args(p)
    out = tmp_path / "heads.json"
    args = p.parse_args(
        [
            str(tiny_model_dir),
            "--out",
            str(out),
            "--random-prompts",
            "--lengths",
            "48",
            "--num-samples",
            "1",
            "--decode-steps",
            "2",
            "--threshold",
            "0",
            "--max-fraction",
            "0.5",
            "--sparse-dense-layers",
            "1",
            "--block-size",
            str(BS),
            "--sparse-local-blocks",
            "2",
            "--device",
            "cpu",
        ]
    )
    res = calibrate.main(args)
    assert res["streaming_heads"] and set(res["streaming_heads"]) == {"1"}  # layer 0 stays dense
    assert len(res["streaming_heads"]["1"]) == 1  # half of the sparse layers' 2 KV heads
    outs, _, _ = run(
        tiny_model_dir,
        sparse_policy="topk",
        sparse_budget=4 * BS,
        sparse_dense_layers=1,
        sparse_local_blocks=2,
        streaming_heads=str(out),
    )
    assert all(len(o) == GREEDY.max_tokens for o in outs)


@pytest.mark.parametrize("lag", [0, 1])
def test_preemption_reuses_state_slots(tiny_model_dir, lag):
    """A KV pool too small for every sequence: preempted sequences give their state slot back and
    select afresh when they run again (lag: from the recomputed prefill's last token); the run completes
    and every block and slot comes back."""
    small_pool = {
        **COMMON,
        "num_gpu_blocks_override": 24,
        "max_model_len": 160,  # prompts + outputs need 32
        "init_new_token_ratio": 0.0,
        "min_new_token_ratio": 0.0,
    }  # admit what fits now: preemptions happen
    llm = LLM(
        str(tiny_model_dir),
        **small_pool,
        sparse_policy="topk",
        sparse_budget=4 * BS,
        sparse_dense_layers=0,
        sparse_local_blocks=2,
        sparse_reuse=2,
        sparse_lag=lag,
    )
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert engine.get_stats().num_preemptions > 0 and engine.get_stats().num_blocks_used == 0
    state = engine.model_runner.attn_backend.state
    assert not state.held_slots() and state.num_free_slots == COMMON["max_num_seqs"]  # every slot back
