"""A GQA group that is not a power of two (SmolLM2-135M's 9 query / 3 KV heads, head_dim 64) through the whole
engine on the Triton kernels (the interpreter on the CPU): dense, topp, and topk under KV offload give the torch
path's greedy tokens, and dense gives transformers'. Tiny: 2 layers, short prompts, a few tokens (the interpreter
pays per program; the kernel tests cover topk without offload)."""

from __future__ import annotations

import pytest
import torch

from sparseserve import LLM, SamplingParams

BS = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
# A context of 2 blocks (all attended) and one of 5 against a budget of 4: selection picks 1 block beside the sink
# and the local window.
SPARSE = dict(
    sparse_budget=4 * BS, sparse_dense_layers=0, sparse_sink_blocks=1, sparse_local_blocks=2, sparse_dense_context=0
)
MODES = {
    "dense": {},
    "topp": dict(sparse_policy="topp", sparse_top_p=0.7, sparse_topp_flat_share=1.0, **SPARSE),  # always prunes
    "topk-offload": dict(sparse_policy="topk", kv_offload=True, hbm_cache_blocks=6, **SPARSE),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (9, 36)]


def generate(model_dir, backend: str, **kw) -> tuple[list[list[int]], LLM]:
    # max_num_batched_tokens 32: the 36-token prompt is prefilled in two chunks, the second beside the other's decode.
    # On a GPU the Triton path's decode steps replay CUDA graphs (the torch path never captures).
    llm = LLM(
        str(model_dir),
        device=DEVICE,
        dtype="float32",
        block_size=BS,
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        kv_cache_memory=1 << 20,
        attention_backend=backend,
        **kw,
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)], llm


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_group3_engine_triton_equals_torch(hf_models, mode):
    path, hf = hf_models["llama-gqa3-d64-tied"]
    assert hf.config.num_attention_heads // hf.config.num_key_value_heads == 3
    want, ref_llm = generate(path, "torch", **MODES[mode])
    got, llm = generate(path, "triton", **MODES[mode])
    assert got == want
    stats, ref_stats = llm.llm_engine.get_stats(sync=True), ref_llm.llm_engine.get_stats(sync=True)
    if mode == "dense":
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            ref = [
                hf.to(DEVICE)
                .generate(
                    torch.tensor([p], device=DEVICE),
                    max_new_tokens=GREEDY.max_tokens,
                    min_new_tokens=GREEDY.max_tokens,
                    do_sample=False,
                    pad_token_id=1,
                )[0, len(p) :]
                .tolist()
                for p in prompts()
            ]
        assert got == ref
    else:  # the sparse path ran, selecting at most the budget's 4 blocks, as many as the torch path did
        assert stats.sparse_selections > 0 and stats.sparse_blocks_selected <= 4 * stats.sparse_selections
        assert (stats.sparse_selections, stats.sparse_blocks_selected) == (
            ref_stats.sparse_selections,
            ref_stats.sparse_blocks_selected,
        )
    if "offload" in mode:
        assert stats.offload_blocks_loaded > 0
        llm.llm_engine.model_runner.offload.pool.check()
