"""Sparse prefill in the attention backends (attention/prefill.py): a mixed step (decodes, a first chunk, chunks
after a cached prefix) through the dense and the sparse backend; threshold 0 is dense prefill, a sale step is
the composition of the kernels' references, rows below min_len and unprepared steps stay dense; the counters;
the calibration file's checks; the config and its flags; the metric names."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata, BackendContext, attend_paged, create_backend
from sparseserve.attention.prefill import SalePrefill, create_prefill, load_prefill_thresholds
from sparseserve.config import EngineConfig, SparseConfig
from sparseserve.engine.stats import EngineStats
from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args
from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.paged_prefill import paged_prefill_ref
from sparseserve.kernels.sale_select import sale_select_ref
from sparseserve.kernels.sparse_prefill import TileLayout, sparse_prefill_ref, tile_classes
from sparseserve.metrics import ServerMetrics, parse_metrics
from tests.kernel_utils import gpu_only, rel_err

DEV = torch.device("cpu")
# (tokens already in the cache, new tokens): two decodes, then a chunk after a 300-token prefix (a prefix-cache
# hit or a later chunk), a first chunk and a short chunk after a 200-token prefix. Key tiles of 64 tokens with a
# sink and a local window of 2 leave middle tiles to select from contexts above 256 tokens.
ROWS = [(399, 1), (89, 1), (300, 150), (0, 330), (200, 70)]
NUM_DECODES = 2


def mixed_step(hq: int, hkv: int, d: int, bs: int, seed: int = 0):
    """(q, k, v, cache, meta, scheduled) of one step over ROWS: shuffled cache blocks holding every earlier
    token's K/V, block tables exactly as wide as the longest context (as the runner builds them)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in ROWS]
    need = [-(-s // bs) for s in seq_lens]
    ids = torch.randperm(sum(need), generator=g, dtype=torch.int32)
    tables = torch.zeros(len(ROWS), max(need), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = ids[start : start + n]
        start += n
    cache = torch.randn(sum(need), hkv, 2, bs, d, generator=g)
    slots = [int(tables[b, pos // bs]) * bs + pos % bs for b, (p, n) in enumerate(ROWS) for pos in range(p, p + n)]
    qsl = torch.tensor([0] + [n for _, n in ROWS]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        torch.tensor(slots),
        qsl,
        torch.tensor(seq_lens, dtype=torch.int32),
        tables,
        NUM_DECODES,
        max(n for _, n in ROWS),
        max(seq_lens),
    )
    scheduled = [
        (SimpleNamespace(seq_id=b, num_computed_tokens=p, block_table=tables[b, : need[b]].tolist()), n)
        for b, (p, n) in enumerate(ROWS)
    ]
    t = len(slots)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, cache, meta, scheduled


def make_backend(
    name: str, hq: int, hkv: int, d: int, bs: int, num_blocks: int, num_layers: int = 1, device: str = "cpu", **prefill
) -> object:
    sparse = (
        dict(
            sparse_policy="topk",
            sparse_budget=4096,
            sparse_dense_layers=0,
            sparse_dense_context=0,
            sparse_local_blocks=2,
        )
        if name == "sparse"
        else {}
    )
    cfg = SparseConfig(**sparse, **prefill)
    ctx = BackendContext(
        num_layers,
        hkv,
        d,
        bs,
        torch.float32,
        torch.device(device),
        max_num_seqs=8,
        max_model_len=4096,
        sparse=cfg,
        num_q_heads=hq,
    )
    backend = create_backend(name, ctx)
    backend.allocate(num_blocks)
    return backend


def run_step(backend, q, k, v, cache, meta, scheduled, layer: int = 0) -> torch.Tensor:
    meta = AttentionMetadata(
        meta.slot_mapping,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.num_decodes,
        meta.max_query_len,
        meta.max_seq_len,
    )
    if scheduled is not None:  # as the runner does: the backend's host inputs, on the device, handed down
        host = backend.step_inputs(scheduled, meta.num_decodes)
        backend.prepare(scheduled, meta, {name: t.to(q.device) for name, t in host.items()})
    return backend.forward(layer, q, k, v, cache, meta, q.shape[-1] ** -0.5)


def prefill_tiles(meta: AttentionMetadata, hkv: int, layout: TileLayout = TileLayout()):
    """(forced, middle) bool [Bp, n_q_tiles, n_k_tiles] of the step's prefill rows."""
    nd = meta.num_decodes
    seq_lens, qsl = meta.seq_lens[nd:], meta.query_start_loc[nd:] - nd
    max_q = max(n for _, n in ROWS[nd:])
    return tile_classes(seq_lens, qsl, layout.num_q_tiles(max_q), layout.num_k_tiles(int(seq_lens.max())), layout)


@pytest.mark.parametrize("name,hq,hkv,d", [("dense", 2, 2, 32), ("sparse", 6, 2, 32), ("dense", 8, 2, 64)])
def test_threshold_zero_is_dense_prefill(name, hq, hkv, d):
    """Threshold 0 keeps every tile: the prefill rows equal dense prefill, the decode rows are untouched, and every
    causally visible tile is counted as computed."""
    bs = 16
    q, k, v, cache, meta, scheduled = mixed_step(hq, hkv, d, bs)
    sale = make_backend(
        name,
        hq,
        hkv,
        d,
        bs,
        cache.shape[0],
        sparse_prefill="sale",
        sparse_prefill_threshold=0.0,
        sparse_prefill_min_len=0,
    )
    plain = make_backend(name, hq, hkv, d, bs, cache.shape[0])
    assert isinstance(sale.prefill, SalePrefill)
    c_sale, c_plain = cache.clone(), cache.clone()
    out = run_step(sale, q, k, v, c_sale, meta, scheduled)
    want = run_step(plain, q, k, v, c_plain, meta, scheduled)
    assert torch.equal(c_sale, c_plain)
    assert torch.equal(out[:NUM_DECODES], want[:NUM_DECODES])
    assert rel_err(out[NUM_DECODES:], want[NUM_DECODES:]) < 1e-5
    assert rel_err(want, attend_paged(q, c_plain, meta, d**-0.5)) < 1e-5  # (sparse decode covers every block)
    counters = sale.counters()
    forced, middle = prefill_tiles(meta, hkv)
    assert middle.any()
    assert (
        int(counters["prefill_tiles_computed"])
        == int(counters["prefill_tiles_dense"])
        == int((forced | middle).sum()) * hkv
    )
    assert "prefill_tiles_dense" not in plain.counters()


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 1)])
def test_sale_step_is_the_reference_composition(hq, hkv):
    """Per-head thresholds, a streaming KV head and a row below min_len, in the second of two layers: the prefill
    rows at or above min_len equal sale_select_ref's tiles attended by sparse_prefill_ref, the row below equals
    dense prefill; the selection drops tiles (the output is not dense's) and the counters count exactly the tiles
    attended."""
    d, bs = 32, 16
    q, k, v, cache, meta, scheduled = mixed_step(hq, hkv, d, bs, seed=1)
    backend = make_backend(
        "dense", hq, hkv, d, bs, cache.shape[0], num_layers=2, sparse_prefill="sale", sparse_prefill_min_len=300
    )
    thr = torch.linspace(0.02, 0.4, hq)
    backend.prefill.thresholds[1] = thr
    streaming = torch.zeros(hkv, dtype=torch.bool)
    streaming[-1] = True
    backend.prefill.streaming[1] = streaming
    out = run_step(backend, q, k, v, cache, meta, scheduled, layer=1)

    nd, t0 = NUM_DECODES, NUM_DECODES  # decodes: one token each
    scale = d**-0.5
    seq_lens, tables = meta.seq_lens[nd:], meta.block_tables[nd:]
    qsl = meta.query_start_loc[nd:] - nd
    max_q, max_s = max(n for _, n in ROWS[nd:]), int(seq_lens.max())
    args = (q[t0:], cache, tables, seq_lens, qsl, scale, max_q, max_s, TileLayout())
    _, index, count = sale_select_ref(*args, thr, streaming)
    sparse = sparse_prefill_ref(*args, index, count)
    dense = paged_prefill_ref(q[t0:], cache, tables, seq_lens, qsl, scale, max_q)
    forced, middle = prefill_tiles(meta, hkv)
    computed = int(forced.sum()) * hkv
    for b, (p, n) in enumerate(ROWS[nd:]):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        got = out[t0:][rows]
        if p + n >= 300:
            assert rel_err(got, sparse[rows]) < 1e-5, b
            assert rel_err(got, dense[rows]) > 1e-3, b  # tiles were left out
            computed += int(count[b].sum())
            assert count[b, -1].sum() == 0  # the streaming head: sink, local and diagonal tiles only
        else:
            assert rel_err(got, dense[rows]) < 1e-5, b
            computed += int(middle[b].sum()) * hkv
    c = backend.counters()
    assert int(c["prefill_tiles_computed"]) == computed < int(c["prefill_tiles_dense"])
    assert int(c["prefill_tiles_dense"]) == int((forced | middle).sum()) * hkv


def test_unprepared_and_short_steps_run_dense():
    """A step nobody prepared (the memory-profiling pass) and a step whose chunks are all below min_len run the
    dense prefill kernel; only the prepared one is counted (all of its tiles computed)."""
    hq, hkv, d, bs = 4, 2, 32, 16
    q, k, v, cache, meta, scheduled = mixed_step(hq, hkv, d, bs, seed=2)
    want = run_step(make_backend("dense", hq, hkv, d, bs, cache.shape[0]), q, k, v, cache.clone(), meta, scheduled)
    for min_len, prepared in ((0, None), (10_000, scheduled)):
        backend = make_backend(
            "dense",
            hq,
            hkv,
            d,
            bs,
            cache.shape[0],
            sparse_prefill="sale",
            sparse_prefill_threshold=0.5,
            sparse_prefill_min_len=min_len,
        )
        out = run_step(backend, q, k, v, cache.clone(), meta, prepared)
        assert rel_err(out[NUM_DECODES:], want[NUM_DECODES:]) < 1e-5
        c = backend.counters()
        computed, dense = int(c["prefill_tiles_computed"]), int(c["prefill_tiles_dense"])
        assert computed == dense and (dense > 0) == (prepared is not None)


@gpu_only
@pytest.mark.parametrize("threshold", [0.0, 1e4])
def test_triton_path_equals_torch_path(threshold):
    """On the GPU: the mixed step through the dense backend with the Triton kernels equals the references (a
    streaming KV head, a row below min_len; thresholds whose decisions sit far from any boundary: every middle
    tile, or none), counters included."""
    hq, hkv, d, bs = 6, 2, 32, 16
    step = mixed_step(hq, hkv, d, bs, seed=3)
    q, k, v, cache = (x.cuda() for x in step[:4])
    meta = step[4]
    meta = AttentionMetadata(
        meta.slot_mapping.cuda(),
        meta.query_start_loc.cuda(),
        meta.seq_lens.cuda(),
        meta.block_tables.cuda(),
        meta.num_decodes,
        meta.max_query_len,
        meta.max_seq_len,
    )
    outs, counts = {}, {}
    for impl in ("torch", "triton"):
        backend = make_backend(
            "dense",
            hq,
            hkv,
            d,
            bs,
            cache.shape[0],
            sparse_prefill="sale",
            sparse_prefill_threshold=threshold,
            sparse_prefill_min_len=300,
            device="cuda",
        )
        backend.prefill.streaming[0] = torch.tensor([False, True], device="cuda")
        with forced(impl):
            outs[impl] = run_step(backend, q, k, v, cache.clone(), meta, step[5])
        counts[impl] = {n: int(c) for n, c in backend.counters().items()}
    assert rel_err(outs["triton"], outs["torch"]) < 1e-5
    assert counts["triton"] == counts["torch"]


# ---- the calibration file -------------------------------------------------------------------------------------


def write(tmp_path, spec) -> str:
    path = tmp_path / "cal.json"
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
    return str(path)


def test_calibration_file_loads(tmp_path):
    thr = [[0.0, 0.5, 0.25, 1e-3], [2.0, 0.0, 0.0, 0.125]]
    path = write(tmp_path, {"sparse_prefill_thresholds": thr, "layout": vars(TileLayout()), "model": "x"})
    assert torch.equal(load_prefill_thresholds(path, 2, 4), torch.tensor(thr))
    ctx = BackendContext(
        2,
        2,
        32,
        16,
        torch.float32,
        DEV,
        4,
        1024,
        num_q_heads=4,
        sparse=SparseConfig(sparse_prefill="sale", sparse_prefill_calibration=path, sparse_prefill_threshold=0.7),
    )
    prefill = create_prefill(ctx)
    assert torch.equal(prefill.thresholds, torch.tensor(thr))  # the file wins over the single threshold
    one = dataclasses.replace(ctx, sparse=SparseConfig(sparse_prefill="sale", sparse_prefill_threshold=0.7))
    assert torch.equal(create_prefill(one).thresholds, torch.full((2, 4), 0.7))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("{not json", "could not read"),
        ({"thresholds": [[0.1] * 4] * 2}, "expected"),
        ({"sparse_prefill_thresholds": [0.1] * 8}, "expected"),
        ({"sparse_prefill_thresholds": [[0.1] * 4] * 3}, "3 x 4"),
        ({"sparse_prefill_thresholds": [[0.1] * 4, [0.1] * 3]}, "2 x 3/4"),
        ({"sparse_prefill_thresholds": [[0.1] * 8] * 2}, "2 x 8"),
        ({"sparse_prefill_thresholds": [[0.1, -0.5, 0.1, 0.1]] * 2}, "layer 0, head 1"),
        ('{"sparse_prefill_thresholds": [[0.1, 0.1, NaN, 0.1], [0.1, 0.1, 0.1, 0.1]]}', "finite"),
        ('{"sparse_prefill_thresholds": [[0.1, 0.1, 0.1, 0.1], [0.1, Infinity, 0.1, 0.1]]}', "layer 1, head 1"),
        ({"sparse_prefill_thresholds": [[0.1, "0.1", 0.1, 0.1]] * 2}, "finite numbers"),
        ({"sparse_prefill_thresholds": [[0.1, True, 0.1, 0.1]] * 2}, "finite numbers"),
        ({"sparse_prefill_thresholds": [[0.1] * 4] * 2, "layout": {"q_tile": 128}}, "tile layout"),
    ],
)
def test_bad_calibration_files_are_refused(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        load_prefill_thresholds(write(tmp_path, spec), 2, 4)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="could not read"):
        load_prefill_thresholds(str(tmp_path / "none.json"), 2, 4)


# ---- config, flags, metrics -----------------------------------------------------------------------------------


def test_config_and_flags(tmp_path):
    args = build_parser(["generate"]).parse_args(
        [
            "generate",
            "--sparse-prefill",
            "sale",
            "--sparse-prefill-threshold",
            "0.05",
            "--sparse-prefill-min-len",
            "4096",
            "--sparse-prefill-calibration",
            "cal.json",
        ]
    )
    kw = engine_kwargs_from_args(args)
    assert (
        kw["sparse_prefill"],
        kw["sparse_prefill_threshold"],
        kw["sparse_prefill_min_len"],
        kw["sparse_prefill_calibration"],
    ) == ("sale", 0.05, 4096, "cal.json")
    cfg = EngineConfig.from_kwargs(sparse_prefill="sale", sparse_prefill_threshold=0.0).sparse_config
    assert cfg.sparse_prefill == "sale" and not cfg.enabled  # sparse prefill needs no sparse decode policy
    for bad, message in (
        (dict(sparse_prefill="flash"), "dense or sale"),
        (dict(sparse_prefill="sale", sparse_prefill_threshold=-1.0), "finite and >= 0"),
        (dict(sparse_prefill="sale", sparse_prefill_threshold=float("nan")), "finite"),
        (dict(sparse_prefill="sale", sparse_prefill_min_len=-1), "min_len"),
        (dict(sparse_prefill_calibration="cal.json"), "needs sparse_prefill='sale'"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs(**bad)
    with pytest.raises(ValueError, match="query heads"):  # a context without the model's head count
        create_prefill(BackendContext(1, 2, 32, 16, torch.float32, DEV, 4, 1024, sparse=cfg))


def test_metrics_expose_prefill_tiles():
    stats = EngineStats(prefill_tiles_computed=30, prefill_tiles_dense=120)
    got = parse_metrics(ServerMetrics(lambda: stats, "m").render().decode())
    assert got["sparseserve:prefill_tiles_computed_total"] == 30
    assert got["sparseserve:prefill_tiles_dense_total"] == 120
    none = parse_metrics(ServerMetrics(lambda: EngineStats(), "m").render().decode())
    assert "sparseserve:prefill_tiles_dense_total" not in none
