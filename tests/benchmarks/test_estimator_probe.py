"""The estimator probe (benchmarks/estimator_probe.py): the min/max estimate bounds each block's true log-sum-exp, the
int4 sketch stays within half a code step, a perfect estimator gives the oracle's figures, and the probe observes a
dense engine's decode queries."""

from __future__ import annotations

import pytest
import torch

from benchmarks import estimator_probe as E

from tests.bench.conftest import haystack_dir


def _true_block_lse(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return E._block_lse(torch.einsum("hgd,hnd->hgn", q, keys))


@pytest.mark.parametrize("page", [8, 16])
def test_min_max_estimate_bounds_every_block(page):
    """The codes round the min down and the max up, so bound + log(tokens) >= the block's lse (the last block
    part-filled)."""
    torch.manual_seed(0)
    keys, q = torch.randn(2, 16 * 9 + 5, 32) * 2, torch.randn(2, 3, 32) * 0.5
    est, true = E.quest(page)(keys, q), _true_block_lse(keys, q)
    assert est.shape == true.shape == (2, 3, 10)
    assert (est >= true - 1e-4).all()
    assert (est - true).max() > 0.1  # a bound, not the value


def test_int4_sketch_within_half_a_step():
    torch.manual_seed(1)
    keys = torch.randn(3, 50, 64) * torch.rand(3, 50, 1) * 4
    amax = keys.abs().amax(-1, keepdim=True)
    sk = E.quantized(4)(keys)
    assert ((sk - keys).abs() <= amax / 14 + 1e-6).all()
    assert sk.div(amax / 7).round().unique().numel() <= 15  # 7 levels a sign and zero
    one = E.quantized(1)(keys)
    assert torch.equal(one.abs(), keys.abs().mean(-1, keepdim=True).expand_as(keys))


def test_exact_keys_reproduce_the_oracle():
    """An estimator that is the keys themselves ranks as the oracle does: the same cover, prunes and tokens."""
    torch.manual_seed(2)
    n = 16 * 200
    keys, q = torch.randn(2, n, 32), torch.randn(2, 4, 32)
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys), -1).mean(1)
    mass = probs.view(2, -1, 16).sum(-1)
    forced = torch.zeros(200, dtype=torch.bool)
    forced[:1] = forced[-4:] = True
    study = E.Study(0)
    study._record("oracle", mass, mass, forced, n)
    weight = torch.softmax(E.token_sketch(lambda k: k)(keys, q), -1).mean(1)
    study._record("exact", weight, mass, forced, n)
    rep = study.report()
    for metric, value in rep["oracle"].items():
        assert rep["exact"][metric] == pytest.approx(value, abs=1e-5), metric
    for cap in E.CAPS:
        o = rep["oracle"]
        assert o[f"exact prune {cap} mass"] >= E.TOP_P * o[f"cover {cap}"] - 1e-6
        assert o[f"exact prune {cap} tokens"] <= min(cap, n)
    assert rep["oracle"]["cover 4096"] == pytest.approx(1.0)  # 200 blocks of 16 fit a cap of 4,096


def test_a_design_pruned_on_true_masses_is_the_exact_prune():
    """Candidates by the min/max estimate, pruned on the true block masses: the ranker's exact prune, kept blocks and
    mass alike; pruned on its own estimate: its key-free prune."""
    torch.manual_seed(3)
    n = 16 * 300 + 7
    keys, q = torch.randn(2, n, 32) * 1.5, torch.randn(2, 4, 32)
    probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, keys), -1).mean(1)
    mass = torch.nn.functional.pad(probs, (0, -n % 16)).view(2, -1, 16).sum(-1)
    forced = torch.zeros(mass.shape[1], dtype=torch.bool)
    forced[:1] = forced[-4:] = True
    rank = torch.softmax(E.quest(16)(keys, q), -1).mean(1)
    study = E.Study(0)
    study._record("quest", rank, mass, forced, n)
    study._record_design("on true masses", rank, mass, mass, forced, n)
    study._record_design("on its own", rank, rank, mass, forced, n)
    rep = study.report()
    for cap in E.CAPS[1:]:
        for stat in ("mass", "tokens"):
            assert rep["on true masses"][f"pruned {cap} {stat}"] == pytest.approx(
                rep["quest"][f"exact prune {cap} {stat}"]
            )
            assert rep["on its own"][f"pruned {cap} {stat}"] == pytest.approx(rep["quest"][f"est prune {cap} {stat}"])


def test_probe_observes_the_engine_decode_queries():
    """Through a dense engine on the embedded model: one query a prompt and decode step, every estimator reported,
    and a cap over the whole context covers all of it."""
    haystack_dir()
    study = E.run(None, 512, samples=1, steps=2)
    assert study.num_prompts == 5 and study.num_queries == 10
    rep = study.report()
    assert set(rep) == {"oracle", *E.ESTIMATORS, *E.DESIGNS}
    for name in ("oracle", *E.ESTIMATORS):
        assert rep[name]["cover 1024"] == pytest.approx(1.0, abs=1e-4), name
        assert rep[name]["est prune 2048 mass"] <= rep[name]["cover 2048"] + 1e-6
    for name in E.DESIGNS:  # every block a candidate: the pruner's masses alone decide
        assert rep[name]["pruned 2048 mass"] == pytest.approx(rep[E.DESIGNS[name][1]]["est prune 2048 mass"])
    assert "int4" in E.format_report(study)
