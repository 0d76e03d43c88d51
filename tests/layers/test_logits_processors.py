"""The sampler's logits processors against references written out per row and token: penalties (repetition,
frequency, presence), logit_bias, min_tokens, grammar bitmasks, and placeholder tokens read from the feed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sparseserve.engine.overlap import TokenFeed

from sparseserve.layers.logits_processors import LogitsProcessors, apply_token_bitmask
from sparseserve.layers.sampler import Sampler, SamplingMetadata
from sparseserve.sampling_params import ParameterError, SamplingParams

V = 64


@dataclass
class Seq:
    """What the processors read of a sequence."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    grammar: object = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


def reference(logits: torch.Tensor, seqs: list[Seq], feed: dict[int, int] | None = None) -> torch.Tensor:
    """The definitions, one row and token at a time (vLLM's order: min_tokens, logit_bias, penalties)."""
    out = logits.clone()
    for b, s in enumerate(seqs):
        p = s.params
        outs = [feed[s.seq_id] if t == -1 else t for t in s.output]
        if p.min_tokens and len(s.output) < p.min_tokens:
            for t in p.all_stop_token_ids | set(p.stop_token_ids):
                out[b, t] = float("-inf")
        for t, v in (p.logit_bias or {}).items():
            out[b, t] += v
        for t in range(V):
            count = outs.count(t)
            if p.repetition_penalty != 1.0 and (count or t in s.prompt_token_ids):
                x = out[b, t]
                out[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            out[b, t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def make_seqs() -> list[Seq]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.5),
        SamplingParams(),
        SamplingParams(logit_bias={3: 100.0, 7: -5.5}, presence_penalty=1.5),
        SamplingParams(
            min_tokens=15, max_tokens=100, stop_token_ids=[9, 11], repetition_penalty=0.8, frequency_penalty=-1.0
        ),
    ]
    params[4].all_stop_token_ids = {1, 9, 11}
    return [Seq(i, rnd(5 + i), p, rnd(3 * i)) for i, p in enumerate(params)]


def test_penalties_bias_and_min_tokens_match_the_definitions():
    seqs = make_seqs()
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(1)) * 3
    proc = LogitsProcessors.build(seqs, V, torch.device("cpu"))
    proc.begin_step(seqs)
    assert proc.penalty_rows == [0, 1, 3, 4] and proc.min_rows == [4]
    got = proc.apply(logits.clone())
    torch.testing.assert_close(got, reference(logits, seqs))
    assert torch.isinf(got[4, [1, 9, 11]]).all() and got[3].argmax() == 3  # min_tokens masks; +100 wins
    seqs[4].output += [0] * 3  # min_tokens reached: nothing masked any more
    proc.begin_step(seqs)
    got = proc.apply(logits.clone())
    torch.testing.assert_close(got, reference(logits, seqs))
    assert torch.isfinite(got[4]).all()


def test_placeholder_tokens_are_read_from_the_feed():
    seqs = make_seqs()
    feed_rows = {s.seq_id: r for r, s in enumerate(reversed(seqs))}
    feed_tokens = torch.randint(0, V, (len(seqs),))
    for s in seqs:
        s.output.append(-1)  # async scheduling: the previous step's token is on the device
    logits = torch.randn(len(seqs), V)
    proc = LogitsProcessors.build(seqs, V, torch.device("cpu"))
    proc.begin_step(seqs, TokenFeed(feed_tokens, feed_rows))
    values = {sid: int(feed_tokens[r]) for sid, r in feed_rows.items()}
    torch.testing.assert_close(proc.apply(logits.clone()), reference(logits, seqs, values))


def test_a_batch_without_processors_builds_none():
    seqs = [Seq(0, [1, 2], SamplingParams()), Seq(1, [3], SamplingParams(temperature=0.5, top_k=3))]
    assert LogitsProcessors.build(seqs, V, torch.device("cpu")) is None


def test_token_bitmask_masks_exactly_the_cleared_bits():
    vocab = 70  # not a multiple of 32: the last word's high bits fall outside the vocabulary
    allowed = torch.rand(3, vocab) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement bit 31
    logits = torch.randn(5, vocab)
    rows = torch.tensor([4, 0, 2])
    got = logits.clone()
    apply_token_bitmask(got, rows, bitmask)
    expected = logits.clone()
    for i, r in enumerate(rows.tolist()):
        expected[r][~allowed[i]] = float("-inf")
    torch.testing.assert_close(got, expected)


def test_sampler_reports_raw_logprobs_and_samples_processed_logits():
    seqs = [Seq(0, [1], SamplingParams(temperature=0.0, logit_bias={5: 100.0}, logprobs=1))]
    proc = LogitsProcessors.build(seqs, V, torch.device("cpu"))
    proc.begin_step(seqs)
    logits = torch.randn(1, V)
    meta = SamplingMetadata(
        temperature=torch.zeros(1),
        top_k=torch.full((1,), V),
        top_p=torch.ones(1),
        min_p=torch.zeros(1),
        generators={},
        all_greedy=True,
        need_top_k=False,
        need_top_p=False,
        need_min_p=False,
        max_num_logprobs=1,
        processors=proc,
    )
    out = Sampler(torch.Generator())(logits, meta)
    assert out.token_ids.tolist() == [5]
    torch.testing.assert_close(out.logprobs[0, 0], torch.log_softmax(logits, -1)[0, 5])


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={1: float("inf")}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
        (dict(structured_outputs={"choice": []}), "structured_outputs.choice"),
    ],
)
def test_invalid_fields_name_their_param(kw, param):
    with pytest.raises(ParameterError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_logit_bias_keys_and_values_are_normalized():
    p = SamplingParams(logit_bias={"12": 250, 3: -0.5})
    assert p.logit_bias == {12: 100.0, 3: -0.5}  # OpenAI's range: values are clamped to [-100, 100]
