"""Decode-step perplexity (bench/perplexity.py): the engine's teacher-forced log-probabilities against one
transformers forward pass on the same weights, every scored token computed by a decode step, and the sparse
policy on the path (a budget covering every block equals dense, a tight one does not)."""

from __future__ import annotations

import math

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.bench import perplexity as P
from sparseserve.workloads import tasks as T

PREFIX, TOKENS = 56, 9


@pytest.fixture(scope="module")
def windows(tiny_model_dir):
    from transformers import AutoTokenizer

    try:
        essays = T.load_essays(T.find_haystack_dir())
    except FileNotFoundError:
        essays = T.builtin_filler()  # varied sentences: the windows differ as essays' do
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return P.essay_windows(T.TaskBuilder(tok, essays), PREFIX, TOKENS, 3, seed=0)


def _llm(model_dir, **kw) -> tuple[LLM, P.TeacherForcing]:
    tf = P.TeacherForcing()
    return LLM(str(model_dir), profiler=tf, device="cpu", dtype="float32", max_model_len=128, block_size=8, **kw), tf


def test_windows(windows):
    assert len(windows) == 3
    for w in windows:
        assert len(w.prefix_ids) == PREFIX and len(w.target_ids) == TOKENS + 1
    assert len({tuple(w.prefix_ids) for w in windows}) == 3


def test_dense_equals_transformers_teacher_forcing(tiny_model_dir, hf_models, windows):
    llm, tf = _llm(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS + 1, ignore_eos=True)
    for i, w in enumerate(windows):  # the raw run, to see which step produced each score
        tf.targets[f"w{i}"] = w.target_ids
        llm.llm_engine.add_request(f"w{i}", w.prefix_ids, params)
    done = {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():  # deltas
            for c in out.outputs:
                done.setdefault(out.request_id, []).extend(c.token_ids)
    # The engine appended the targets, not its own greedy picks, and every score came from a decode step.
    assert [done[f"w{i}"] for i in range(3)] == [w.target_ids for w in windows]
    assert tf.run.decode_scored == 3 * TOKENS and tf.run.other_scored == 0
    # Requests without targets keep their own greedy tokens (the profiler forces nothing for them).
    own = llm.generate([w.prefix_ids for w in windows], params, use_tqdm=False)
    plain = _llm(tiny_model_dir)[0].generate([w.prefix_ids for w in windows], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in own] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in own] != [w.target_ids for w in windows]

    ours = P.forced_logprobs(llm, tf, windows)
    ref = P.reference_logprobs(hf_models["llama3-gqa-d128-tied-rope"][1], windows)
    assert [len(r) for r in ours] == [TOKENS] * 3
    assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-4, rtol=1e-4)
    s = P.summarize(ours)
    assert s["tokens"] == 3 * TOKENS
    assert s["nll"] == pytest.approx(-sum(map(sum, ref)) / (3 * TOKENS), abs=1e-4)
    assert s["ppl"] == pytest.approx(math.exp(s["nll"]))


def test_sparse_policy_is_on_the_path(tiny_model_dir, windows):
    dense = P.forced_logprobs(*_llm(tiny_model_dir), windows)
    # Every decode through scoring, selection and the sparse kernel (sparse_dense_context=0); a budget that
    # covers every block is dense attention.
    full = P.forced_logprobs(
        *_llm(tiny_model_dir, sparse_policy="topk", sparse_budget=128, sparse_dense_context=0, sparse_dense_layers=0),
        windows,
    )
    assert torch.allclose(torch.tensor(full), torch.tensor(dense), atol=1e-4)
    llm, tf = _llm(
        tiny_model_dir,
        sparse_policy="topk",
        sparse_budget=24,
        sparse_dense_context=0,
        sparse_dense_layers=0,
        sparse_local_blocks=1,
    )
    tight = P.forced_logprobs(llm, tf, windows)
    stats = llm.llm_engine.get_stats(sync=True)
    assert stats.sparse_selections > 0 and stats.sparse_blocks_selected / stats.sparse_selections <= 3
    assert not torch.allclose(torch.tensor(tight), torch.tensor(dense), atol=1e-3)
    assert all(math.isfinite(x) for row in tight for x in row)


def test_summarize_empty():
    assert P.summarize([[]])["tokens"] == 0
