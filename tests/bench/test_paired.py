"""The accuracy harness's paired comparison with dense (bench/paired.py) on synthetic per-sample scores."""

from __future__ import annotations

import numpy as np
import pytest

from sparseserve.bench import accuracy
from sparseserve.bench import paired as PD


def _scores(seed: int, n: int, p: float = 0.5) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_identical_policies_zero_width():
    a = _scores(0, 500)
    tasks = np.repeat(list("abcde"), 100)
    d = PD.paired_diff(a, a.copy(), tasks)
    assert (d.diff, d.diff_low, d.diff_high) == (0.0, 0.0, 0.0)
    assert (d.n, d.better, d.worse) == (500, 0, 0) and d.within_1_point


def test_constant_shift_recovered_exactly():
    a = np.random.default_rng(1).random(300) * 0.5  # partial-credit-like scores
    d = PD.paired_diff(a, a + 0.25)
    assert d.diff == pytest.approx(0.25)
    assert d.diff_low == pytest.approx(0.25, abs=1e-12) and d.diff_high == pytest.approx(0.25, abs=1e-12)
    assert d.better == 300 and d.worse == 0


def test_known_shift_with_noise():
    # 25 of dense's right answers lost, 10 wrong ones gained: exactly -15 of 500 = -3 points.
    a = _scores(2, 500)
    b = a.copy()
    right, wrong = np.flatnonzero(a == 1), np.flatnonzero(a == 0)
    b[right[:25]] = 0
    b[wrong[:10]] = 1
    d = PD.paired_diff(a, b)
    assert d.diff == pytest.approx(-0.03)
    assert (d.better, d.worse) == (10, 25)
    assert d.diff_low < -0.03 < d.diff_high
    # The half-width is the normal interval's of the per-sample differences (large n), to 15%.
    diffs = b - a
    half = 1.96 * diffs.std(ddof=1) / np.sqrt(len(diffs))
    assert (d.diff_high - d.diff_low) / 2 == pytest.approx(half, rel=0.15)
    assert not d.within_1_point


def test_pairing_narrows_the_interval():
    """Two noisy means 5 samples apart are not told apart; the paired difference is."""
    a = _scores(3, 500)
    b = a.copy()
    b[np.flatnonzero(a == 1)[:5]] = 0  # -1 point, every other sample the same
    d = PD.paired_diff(a, b)
    assert d.diff == pytest.approx(-0.01) and d.within_1_point
    unpaired_half = 1.96 * np.sqrt(2 * 0.25 / 500)  # two independent means' difference at accuracy 0.5
    assert d.diff_high - d.diff_low < 0.3 * unpaired_half and -0.02 <= d.diff_low < -0.01 <= d.diff_high


def test_stratified_by_task():
    """The statistic is the mean over tasks; resampling within tasks keeps their counts."""
    ref = np.ones(10)
    pol = np.array([0, 0] + [1] * 8, dtype=float)  # task x (2 samples) all lost, task y (8) all kept
    tasks = ["x", "x"] + ["y"] * 8
    d = PD.paired_diff(ref, pol, tasks)
    assert d.diff == pytest.approx(-0.5)  # (-1 + 0) / 2, not -2 / 10
    assert d.diff_low == pytest.approx(-0.5) and d.diff_high == pytest.approx(-0.5)  # no variance within a task
    pooled = PD.paired_diff(ref, pol)
    assert pooled.diff == pytest.approx(-0.2) and pooled.diff_high - pooled.diff_low > 0.2


def test_interval_coverage():
    """Over simulated runs with a true difference of -1 point, the 95% interval holds it about 95% of the time."""
    rng = np.random.default_rng(4)
    hits, runs = 0, 200
    for i in range(runs):
        a = (rng.random(300) < 0.5).astype(float)
        u = rng.random(300)
        # 5% set to 0, 3% to 1, each from accuracy 0.5: E[diff] = -0.05 / 2 + 0.03 / 2 = -0.01
        b = np.where(u < 0.05, 0.0, np.where(u < 0.08, 1.0, a))
        d = PD.paired_diff(a, b, resamples=2000, seed=i)
        hits += d.diff_low <= -0.01 <= d.diff_high
    assert 0.88 <= hits / runs <= 0.99


def test_deterministic():
    a, b = _scores(5, 200), _scores(6, 200)
    assert PD.paired_diff(a, b) == PD.paired_diff(a, b)


@pytest.mark.parametrize(
    ("diff", "low", "within"),
    [
        (0.0, 0.0, True),
        (-0.01, -0.02, True),  # both at their floors
        (-5 / 500, -0.019, True),  # 5 losses in 500: -1 point exactly, despite float rounding
        (-0.0101, -0.015, False),  # mean below -1 point
        (-0.005, -0.0201, False),  # interval reaches past -2 points
        (0.02, -0.021, False),
    ],
)
def test_within_1_point(diff, low, within):
    assert PD.within_1_point(diff, low) is within


def test_bad_input():
    with pytest.raises(ValueError, match="equal"):
        PD.paired_diff([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="no paired"):
        PD.paired_diff([], [])
    with pytest.raises(ValueError, match="strata"):
        PD.paired_diff([1.0, 0.0], [1.0, 1.0], ["a"])
    with pytest.raises(ValueError, match="confidence"):
        PD.paired_diff([1.0], [1.0], confidence=1.0)


def _rows(scores, task="t", length=8):
    return [{"task": task, "length": length, "answer": str(i), "correct": c} for i, c in enumerate(scores)]


def test_compare_rows_pairs_by_sample():
    dense = _rows([1, 1, 0, 1]) + _rows([1, 0], length=16)
    pol = _rows([1, 0, 0, 1]) + _rows([1, 1], length=16)
    assert PD.compare_rows(dense, pol, 8).diff == pytest.approx(-0.25)
    assert PD.compare_rows(dense, pol, 16).diff == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not the same sample"):
        PD.compare_rows(dense, pol[::-1])
    with pytest.raises(ValueError, match="cannot pair"):
        PD.compare_rows(dense, pol[:-1])


def test_paired_report_and_table():
    rows = {
        "dense": _rows([1, 1, 0, 1], "a") + _rows([1, 0, 1, 1], "b"),
        "topk": _rows([1, 0, 0, 1], "a") + _rows([1, 0, 1, 1], "b"),
        "same": _rows([1, 1, 0, 1], "a") + _rows([1, 0, 1, 1], "b"),
    }
    ppl = {"dense": {"8": {"ppl": 10.0}}, "topk": {"8": {"ppl": 10.1}}}
    attended = {"dense": {"8": 8.0}, "topk": {"8": 4.0}}
    rep = PD.paired_report(rows, [8], ppl, attended)
    assert [e["policy"] for e in rep] == ["topk", "same"]
    top, same = rep
    fields = {"policy", "length", "n", "accuracy", "dense_accuracy", "diff", "diff_low", "diff_high", "better"}
    assert fields | {"worse", "within_1_point", "ppl_ratio", "tokens_attended"} == set(top)
    assert top["n"] == 8 and top["accuracy"] == pytest.approx(0.625) and top["dense_accuracy"] == 0.75
    assert top["diff"] == pytest.approx(-0.125) and top["worse"] == 1 and not top["within_1_point"]
    assert top["ppl_ratio"] == pytest.approx(1.01) and top["tokens_attended"] == 4.0
    assert same["diff"] == 0 and same["within_1_point"] and same["ppl_ratio"] is None
    lines = PD.format_paired(rep).splitlines()
    assert "95% interval" in lines[0] and "within 1 point" in lines[0]
    assert lines[1].split()[0] == "topk" and "-12.5" in lines[1] and "1.0100" in lines[1] and lines[1].endswith("no")
    assert "[+0.0, +0.0]" in lines[2] and lines[2].endswith("yes")


def test_samples_per_task():
    assert accuracy.samples_per_task(None, 500, 5) == 100
    assert accuracy.samples_per_task(None, 501, 5) == 101  # rounded up: at least what was asked
    assert accuracy.samples_per_task(7, None, 5) == 7
    assert accuracy.samples_per_task(None, None, 5) == accuracy.NUM_SAMPLES
    with pytest.raises(ValueError, match="not both"):
        accuracy.samples_per_task(7, 500, 5)
    with pytest.raises(ValueError, match=">= 1"):
        accuracy.samples_per_task(None, 0, 5)
