"""SparseBackend (attention/sparse.py): store, select, attend through the whole layer on either kernel path,
lagged selection, and the captured sparse decode on the GPU."""

from __future__ import annotations

import pytest
import torch

from sparseserve.attention.backend import AttentionMetadata, BackendContext, attend_paged
from sparseserve.attention.sparse import SparseBackend, SparseStepMeta
from sparseserve.config import SparseConfig
from sparseserve.kernels.block_score import block_scores_ref, flat_rows_ref, select_ref
from sparseserve.kernels.dispatch import forced
from sparseserve.kernels.key_meta import rebuild_key_meta
from sparseserve.kernels.sparse_decode import sparse_decode_ref
from sparseserve.kernels.topp_prune import block_lse_ref, prune_ref
from tests.kernel_utils import DEVICE as DEV
from tests.kernel_utils import gpu_only, rel_err
from tests.kernels.test_sparse_kernels import decode_batch


def sparse_backend(
    policy: str, budget: int, bs: int, hkv: int, d: int, dtype, num_blocks: int, num_layers: int = 1, **kw
) -> SparseBackend:
    cfg = SparseConfig(
        sparse_policy=policy,
        sparse_budget=budget,
        sparse_dense_layers=0,
        sparse_dense_context=0,
        sparse_local_blocks=2,
        **kw,
    )
    ctx = BackendContext(num_layers, hkv, d, bs, dtype, DEV, max_num_seqs=8, max_model_len=1 << 20, sparse=cfg)
    backend = SparseBackend(ctx)
    backend.allocate(num_blocks)
    return backend


def with_slots(meta: AttentionMetadata) -> AttentionMetadata:
    """Row b in state slot b (what the runner's prepare gives a batch of fresh sequences)."""
    slots = torch.arange(meta.num_seqs, dtype=torch.int32, device=DEV)
    meta.backend_meta = SparseStepMeta(slots, meta)
    return meta


@pytest.mark.slow
@pytest.mark.parametrize("policy,budget", [("topk", 4096), ("topk", 64), ("topp", 96)])
def test_backend_triton_vs_torch(policy, budget):
    """A decode batch (store, metadata update, scoring, selection, attention) through SparseBackend on each
    kernel path; with a budget covering every block the sparse path equals dense attention."""
    torch.manual_seed(4)
    hq, hkv, d, bs = 8, 2, 32, 16
    q, cache, meta = decode_batch([0, 150, 70, 33], hq, hkv, d, bs, torch.float32, slack=bs)
    k, v = torch.randn(meta.num_seqs, hkv, d, device=DEV), torch.randn(meta.num_seqs, hkv, d, device=DEV)
    meta.slot_mapping = torch.tensor(
        [-1]
        + [
            int(meta.block_tables[b, (n - 1) // bs]) * bs + (n - 1) % bs
            for b, n in enumerate(meta.seq_lens.tolist())
            if b > 0
        ],
        device=DEV,
    )
    with_slots(meta)
    outs, caches = [], []
    for impl in ("torch", "triton"):
        backend = sparse_backend(policy, budget, bs, hkv, d, torch.float32, cache.shape[0])
        c = cache.clone()
        rebuild_key_meta(c[None], backend.key_meta.codes, backend.key_meta.scale, bs)
        with forced(impl):
            outs.append(backend.forward(0, q, k, v, c, meta, d**-0.5))
        caches.append(c)
    assert torch.equal(caches[0], caches[1])
    assert rel_err(outs[1], outs[0]) < 1e-5
    if budget >= 150:
        with forced("torch"):
            assert rel_err(outs[0], attend_paged(q, caches[0], meta, d**-0.5)) < 1e-5


def _extend(cache: torch.Tensor, meta: AttentionMetadata, steps: int, bs: int) -> torch.Tensor:
    """Fresh cache blocks for the block-table entries the next `steps` tokens of each sequence enter."""
    extra = []
    for b, n in enumerate(meta.seq_lens.tolist()):
        for blk in range(-(-n // bs) if n else 0, -(-(n + steps) // bs) if n else 0):
            meta.block_tables[b, blk] = cache.shape[0] + len(extra)
            extra.append(torch.randn_like(cache[0]))
    return torch.cat([cache, torch.stack(extra)]) if extra else cache


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("policy,reuse", [("topk", 1), ("topk", 2), ("topp", 1), ("topp", 2)])
def test_lagged_selection(impl, policy, reuse):
    """sparse_lag=1 through SparseBackend.forward: a prefill's last token selects, then decode steps. Each decode
    attends the list of the latest earlier selection (the prefill's end, then each decode at a context that is
    a multiple of R), recomputed here from the references on the queries and key metadata of that step; topp
    prunes those candidates with each step's own query, except lists whose candidates were flat, which take
    flat_cap blocks where the cap cannot reach p on them, unpruned (the counters report what the steps
    attended)."""
    torch.manual_seed(9)
    hq, hkv, d, bs, steps, scale = 8, 2, 32, 16, 4, 32**-0.5
    q, cache, meta = decode_batch([158, 0, 95, 200], hq, hkv, d, bs, torch.float32, slack=steps + 1)
    cache = _extend(cache, meta, steps, bs)
    # a flat share at which some lists are flat, some of them short, and others are not (random keys)
    topp = dict(sparse_top_p=0.7, sparse_topp_flat_share=0.5) if policy == "topp" else {}
    backend = sparse_backend(
        policy, 6 * bs, bs, hkv, d, torch.float32, cache.shape[0], sparse_reuse=reuse, sparse_lag=1, **topp
    )
    rebuild_key_meta(cache[None], backend.key_meta.codes, backend.key_meta.scale, bs)
    with_slots(meta)
    p, mb = backend.params, -(-meta.max_seq_len // bs)
    live = meta.seq_lens > 0
    latest = torch.full((4, hkv, p.cap), -1, dtype=torch.int32, device=DEV)
    latest_flat = torch.zeros(4, hkv, dtype=torch.bool, device=DEV)
    rows = torch.arange(4, device=DEV)
    selections = attended = candidates = 0
    seen = torch.zeros(3, dtype=torch.int64, device=DEV)  # selected lists: flat, short, not flat
    for step in range(steps + 1):  # step 0: a prefill chunk of one token a sequence; then decodes
        if step:
            meta.seq_lens += live.to(torch.int32)
        meta.num_decodes = 0 if step == 0 else 4
        pos = (meta.seq_lens.long() - 1).clamp_min(0)
        meta.slot_mapping = torch.where(
            live, meta.block_tables.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs, -1
        )
        q, k, v = (3 * torch.randn(4, h, d, device=DEV) for h in (hq, hkv, hkv))
        with forced(impl):
            out = backend.forward(0, q, k, v, cache, meta, scale)
        if step:
            lists = latest
            if policy == "topp":
                lse = block_lse_ref(q, cache, meta.block_tables, meta.seq_lens, latest, scale)
                kw = dict(sink=p.sink, local=p.local, top_p=p.top_p, short_dense=p.short_dense)
                lists = torch.where(
                    latest_flat[..., None], latest, prune_ref(lse, latest, meta.seq_lens, block_size=bs, **kw)
                )
                selections += int(live.sum()) * hkv
                attended += int((lists[live] >= 0).sum())
                candidates += int((latest[live] >= 0).sum())
            ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, lists, rows, p.local, scale)
            assert rel_err(out[live], ref[live]) < 1e-5, step
        km = backend.key_meta[0]
        scores = block_scores_ref(q, km.codes, km.scale, meta.block_tables, meta.seq_lens, mb, bs, scale)
        streaming = torch.zeros(hkv, dtype=torch.bool, device=DEV)
        # forcing the local window of the next step, which reads the list
        kw = dict(block_size=bs, cap=p.cap, sink=p.sink, local=p.local, short_dense=p.short_dense, ahead=1)
        flat = short = torch.zeros(4, hkv, dtype=torch.bool, device=DEV)
        if policy == "topp":
            flat, short = flat_rows_ref(
                scores, meta.seq_lens, streaming, flat_share=p.flat_share, flat_mass=p.top_p, **kw
            )
        # sticky (the default) to the list this step attends (topp: the candidates)
        lists = select_ref(
            scores,
            meta.seq_lens,
            streaming,
            prev=latest,
            stickiness=p.stickiness,
            short=short,
            flat_cap=p.flat_cap,
            **kw,
        )
        due = live & ((step == 0) | (meta.seq_lens % reuse == 0))
        latest = torch.where(due[:, None, None], lists, latest)
        latest_flat = torch.where(due[:, None], flat, latest_flat)
        seen += torch.stack([(flat & due[:, None]).sum(), (short & due[:, None]).sum(), (~flat & due[:, None]).sum()])
        if policy == "topk":
            selections += int(due.sum()) * hkv
    assert int(backend.state.stats[1]) == selections
    if policy == "topp":
        assert int(backend.state.stats[0]) == attended < candidates  # pruned, and counted once a step
        assert (seen > 0).all(), seen


@gpu_only
@pytest.mark.parametrize("policy", ["topk", "topp"])
def test_large_decode_cuda_graph(policy):
    """Llama-8B head shapes, 64K context, bf16: the captured sparse decode (scoring, selection with reuse,
    kernel) replays against the references computed from the lists it left."""
    torch.manual_seed(5)
    hq, hkv, d, bs, lens = 32, 8, 128, 32, [65536, 40000, 0, 2047]
    q, cache, meta = decode_batch(lens, hq, hkv, d, bs, torch.bfloat16)
    backend = sparse_backend(policy, 2048, bs, hkv, d, torch.bfloat16, cache.shape[0], sparse_reuse=2)
    rebuild_key_meta(cache[None], backend.key_meta.codes, backend.key_meta.scale, bs)
    sm = with_slots(meta).backend_meta
    backend.attend(0, q, cache, meta, d**-0.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(0, q, cache, meta, d**-0.5)
    backend.state.counter.zero_()
    for step in range(3):
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = sparse_decode_ref(q, cache, meta.block_tables, meta.seq_lens, backend.state.sel[0], sm.slots, 2, d**-0.5)
        assert rel_err(out, ref) < 1e-2, step
    nb = (meta.seq_lens + bs - 1) // bs
    counts = (backend.state.sel[0][: len(lens)] >= 0).sum(-1)
    assert (counts[:2] <= 64).all() and (counts[3] <= nb[3]).all()
    if policy == "topk":  # with sparse_dense_context=0 a short context is still scored: all of it fits
        assert (counts[:2] == 64).all() and (counts[3] == nb[3]).all()


@gpu_only
def test_engine_gpu_sparse_equals_dense(hf_models):
    """float32 on the GPU: a covering budget through scoring, selection and the sparse kernel matches
    dense attention (probe, eager) and gives dense's tokens with CUDA graphs (an untied model, whose
    logits are far apart); a small budget (reuse, hierarchical pages) runs and frees every block."""
    from sparseserve import LLM, SamplingParams
    from sparseserve.bench.attention_probe import AttentionProbe

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (700, 300, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # A fixed KV size: engines of this test (and other GPU users) must not starve each other's profiling.
    common = dict(
        device="cuda", dtype="float32", block_size=16, max_model_len=1024, max_num_seqs=4, kv_cache_memory=256 << 20
    )
    full = dict(sparse_policy="topk", sparse_budget=1024, sparse_dense_layers=0, sparse_dense_context=0)

    llm = LLM(str(hf_models["llama3-gqa-d128-tied-rope"][0]), **common, **full, enforce_eager=True)
    with AttentionProbe(llm.llm_engine.model_runner.attn_backend) as probe:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    layers = probe.report()["layers"].values()
    del llm
    assert all(r["mass_min"] > 1 - 1e-5 and r["rel_err_max"] < 1e-4 for r in layers), layers

    def run(**kw):
        llm = LLM(str(hf_models["qwen2-gqa-bias"][0]), **common, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.llm_engine.get_stats()

    dense, _ = run()
    sparse, stats = run(**full)
    assert sparse == dense and stats.sparse_selections > 0
    lagged, stats = run(**full, sparse_lag=1)  # selection on a side stream of the captured graphs
    assert lagged == dense and stats.sparse_selections > 0
    small, stats = run(
        sparse_policy="topp",
        sparse_budget=128,
        sparse_top_p=0.8,
        sparse_reuse=4,
        logical_page_size=4,
        sparse_dense_layers=1,
    )
    assert all(len(o) == params.max_tokens for o in small) and stats.num_blocks_used == 0
    assert stats.sparse_blocks_selected <= stats.sparse_selections * 128 // 16
