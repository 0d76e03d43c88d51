"""Sampler semantics on tensors, and sampling options end to end."""

from __future__ import annotations

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.layers.sampler import Sampler, SamplingMetadata, apply_top_k_top_p


def meta(b, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, generators=None, logprobs=None, vocab=50):
    return SamplingMetadata(
        temperature=torch.full((b,), temperature),
        top_k=torch.full((b,), top_k or vocab),
        top_p=torch.full((b,), top_p),
        min_p=torch.full((b,), min_p),
        generators=generators or {},
        all_greedy=temperature == 0,
        need_top_k=top_k is not None,
        need_top_p=top_p < 1,
        need_min_p=min_p > 0,
        max_num_logprobs=logprobs,
    )


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = apply_top_k_top_p(logits, torch.tensor([4, 2]), torch.tensor([0.7, 1.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.7
    assert torch.isfinite(out[1]).sum() == 2


def test_sampling_follows_distribution_and_filters():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].repeat(20000, 1)
    s = Sampler(torch.Generator().manual_seed(1))
    counts = torch.bincount(s(logits, meta(20000, vocab=3)).token_ids, minlength=3).float() / 20000
    assert torch.allclose(counts, probs, atol=0.02)
    assert set(s(logits, meta(20000, top_k=2, vocab=3)).token_ids.tolist()) == {0, 1}
    assert set(s(logits, meta(20000, min_p=0.4, vocab=3)).token_ids.tolist()) == {0, 1}
    assert set(s(logits, meta(20000, temperature=0.0, vocab=3)).token_ids.tolist()) == {0}


def test_logprobs_and_ranks():
    logits = torch.randn(3, 50)
    out = Sampler(torch.Generator())(logits, meta(3, temperature=0.0, logprobs=4))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs[:, 0], ref.max(-1).values)
    assert out.sampled_ranks.tolist() == [1, 1, 1]
    assert torch.equal(out.logprob_token_ids[:, 1:], ref.topk(4, -1).indices)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=256)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, seed=123, ignore_eos=True)
    alone = llm.generate(["The essay begins"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate(["x y z", "The essay begins", "a long other prompt here"], [others, p, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a, b = (llm.generate(["The essay begins"], unseeded, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert a != b  # the engine generator advances between requests


def test_n_stop_and_logprobs(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True, logprobs=2)
    out = llm.generate(["Hello"], p, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.token_ids) == 8 and len(o.logprobs) == 8 and o.finish_reason == "length"
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert tok in entry and 2 <= len(entry) <= 3
        assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    # Stop token ids and stop strings end the sequence with finish_reason "stop".
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[4]
    o = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok and o.token_ids[-1] == stop_tok
    assert o.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    stop_str = full.text[len(full.text) // 2 :][:3]
    assert stop_str.strip(), full.text
    o = llm.generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_str]), use_tqdm=False
    )[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_str
    assert o.text == full.text[: full.text.index(stop_str)]
    assert llm.llm_engine.allocator.num_used == 0


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Where is the key?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt == text and len(out.outputs[0].token_ids) == 3
    if tok.bos_token_id is not None:  # the template's BOS, once
        assert out.prompt_token_ids.count(tok.bos_token_id) <= 1
