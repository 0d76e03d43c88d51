"""No Triton compilation while serving: after the engine's warm-up (LLMEngine.warm_up), a serving workload launches
no kernel with a compilation key the warm-up did not launch already. On a GPU a new key compiles while requests
wait (seconds each, and under load every later request queues behind it); the warm-up exists to pay for them at
start. Here the keys are read from the launches themselves (tests/kernel_utils.py Specializations): on the CPU
the kernels run under Triton's interpreter with the same arguments, so a key that depends on a step's shape (a
constexpr following the batch or the longest context, an integer argument that is 1 or a multiple of 16 in some
steps only, a view whose alignment follows a row offset) shows here as it would on the GPU. The warm-up runs every
kernel under the interpreter (the engine's step kinds end to end); while serving, an op with a torch reference
launches its kernels dry and returns its reference's result (tests/kernel_utils.py ReferenceLaunches): the keys
are the same, the interpreter's cost is not paid a second time.

The workload mixes what serving meets and a warm-up round may not: prompts of every length up to the model's
limit, decodes beside chunks of several prompts, prefix-cache hits, an abort, and with KV offload a small HBM
pool (working-set hold-backs, prefills ahead, parked requests resumed) or fewer device rows than token blocks (rows
saved to the host while serving)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams
import sparseserve.kernels.paged_decode as decode_ops
import sparseserve.kernels.store_kv as store_ops
from sparseserve.kernels.dispatch import forced
from tests.kernel_utils import ON_GPU, ReferenceLaunches, Specializations

SPARSE = dict(
    sparse_policy="topk",
    sparse_budget=64,
    sparse_dense_layers=0,
    sparse_sink_blocks=1,
    sparse_local_blocks=1,
    sparse_dense_context=0,
)
CONFIGS = {
    "dense": {},
    "topk_sale": dict(SPARSE, sparse_prefill="sale", sparse_prefill_min_len=48),
    "layerseg_async": dict(
        SPARSE,
        kv_offload=True,
        layer_segmented_prefill=True,
        prefill_layer_segment=1,
        async_scheduling=True,
        hbm_cache_blocks=32,
    ),
}
CONFIGS["layerseg_lag_async"] = dict(CONFIGS["layerseg_async"], sparse_lag=1)  # the best measured serving config
# fewer device rows than token blocks (a KV budget, not a block count) and a dense layer: serving saves rows (its KV
# and the metadata) and restores some, the warm-up moves none
FEW_ROWS = dict(kv_cache_memory=4_500_000, host_kv_memory=20_000_000, sparse_dense_layers=1)
CONFIGS["layerseg_lag_few_rows"] = dict(CONFIGS["layerseg_lag_async"], **FEW_ROWS)
CONFIGS["topp"] = dict(SPARSE, sparse_policy="topp", sparse_top_p=0.8)
# prefetching reads, flat lists held (the hold's counter rows and decode rows are launch arguments, not keys)
CONFIGS["topp_prefetch_hold"] = dict(
    CONFIGS["topp"], kv_offload=True, offload_prefetch=True, sparse_topp_flat_hold=2, hbm_cache_blocks=32
)
MAX_MODEL_LEN = 320


def engine_kwargs(name: str) -> dict:
    """The LLM arguments of a config: a tiny fp32 engine on the GPU where there is one."""
    kw = dict(
        device="cuda" if ON_GPU else "cpu",
        dtype="float32",
        block_size=16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=64,
        attention_backend="triton",
        **CONFIGS[name],
    )
    if "kv_cache_memory" not in kw:
        kw["num_gpu_blocks_override"] = 256  # a small cache: engines one after another on a GPU
    return kw


def serve(llm: LLM, seed: int = 0, num_requests: int = 16) -> int:
    """Requests arriving every other step until all finished; returns the steps run."""
    engine, rng = llm.llm_engine, random.Random(seed)
    prompts: list[list[int]] = []
    steps = 0
    while len(prompts) < num_requests or engine.has_unfinished_requests():
        if steps % 2 == 0 and len(prompts) < num_requests:
            n = rng.choice([rng.randint(3, 40), rng.randint(40, MAX_MODEL_LEN - 16)])
            if prompts and rng.random() < 0.4:  # a prefix shared with an earlier prompt, then a short or long rest
                base = rng.choice(prompts)
                rest = rng.choice([8, rng.randint(64, 200)])
                prompt = base[: rng.randint(1, len(base))] + [rng.randrange(10, 4000) for _ in range(rest)]
                prompt = prompt[: MAX_MODEL_LEN - 16]
            else:
                prompt = [rng.randrange(10, 4000) for _ in range(n)]
            engine.add_request(
                f"r{len(prompts)}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True),
            )
            prompts.append(prompt)
            if len(prompts) == num_requests // 2:
                engine.abort_request(f"r{len(prompts) - 3}")
        engine.step()
        steps += 1
        assert steps < 2000
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_serving_compiles_nothing_after_the_warm_up(tiny_model_dir, name):
    kw = engine_kwargs(name)
    with Specializations() as spec:
        llm = LLM(str(tiny_model_dir), **kw)
        if not ON_GPU:  # on CUDA the engine warms up when it is built
            llm.llm_engine.warm_up()
        warm = spec.keys()
        start = len(spec.launches)
        with contextlib.nullcontext() if ON_GPU else ReferenceLaunches():
            steps = serve(llm)
        serving = spec.keys(start)
    assert warm and len(spec.launches) > start, "no kernel launch was seen: the hooks are not in place"
    new = Specializations.differences(serving, warm)
    assert not new, f"compiled while serving ({steps} steps):\n" + "\n".join(new)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.allocator.num_used == 0
    if "kv_cache_memory" in kw:  # the rows serving moved: none before it, some each way while it ran
        stats = engine.get_stats(sync=True)
        assert stats.offload_rows_saved > 0 and stats.offload_rows_restored > 0
    engine.allocator.check()
    if CONFIGS[name].get("kv_offload"):  # the pool was small enough for the working-set control's paths to run
        stats = engine.get_stats(sync=True)
        assert stats.working_set_hold_backs > 0 and stats.working_set_prefill_aheads > 0, stats


@pytest.mark.skipif(ON_GPU, reason="the interpreter's dry launches")
def test_reference_launches_record_the_keys_of_real_launches():
    """ReferenceLaunches: the same launches and keys as the interpreted kernels, the references' results, and
    nothing written by a dry launch (store_kv's cache holds the reference's writes only)."""
    torch.manual_seed(0)
    blocks, hkv, bs, d = 8, 2, 16, 64
    q = torch.randn(3, 4, d)
    tables = torch.randperm(blocks, dtype=torch.int32)[:6].view(3, 2)
    lens = torch.tensor([5, 17, 32], dtype=torch.int32)
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    slots = torch.tensor([3, 40, 127])
    context = torch.randn(blocks, hkv, 2, bs - 5, d)
    runs = []
    for mode in ("interpreted", "reference"):
        cache = torch.zeros(blocks, hkv, 2, bs, d)
        with (
            Specializations() as spec,
            forced("triton"),
            ReferenceLaunches() if mode == "reference" else contextlib.nullcontext(),
        ):
            store_ops.store_kv(k, v, cache, slots)  # (through the modules: ReferenceLaunches patches them)
            cache[:, :, :, 5:] += context  # a context to attend
            out = decode_ops.paged_decode(q, cache, tables, lens, d**-0.5, 32)
        runs.append((spec.launches, cache, out))
    (real_launches, real_cache, real_out), (ref_launches, ref_cache, ref_out) = runs
    assert ref_launches == real_launches and {name for name, _ in real_launches} >= {
        "store_kv._store_kv_kernel",
        "paged_decode._decode_split_kernel",
    }
    assert torch.equal(ref_cache, real_cache)  # the stored rows, written once
    assert torch.equal(ref_out, decode_ops.paged_decode_ref(q, ref_cache, tables, lens, d**-0.5, 32))
    assert torch.allclose(ref_out, real_out, atol=1e-5)
