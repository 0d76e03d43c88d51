"""Paired comparison of a policy with dense on the same prompts: the accuracy difference and its 95% interval.

Every policy answers the same samples, so the comparison is per sample: d_i = score_i(policy) - score_i(dense).
The statistic is the mean over tasks of each task's mean d_i (the same as the difference of the mean-over-tasks
accuracies the tables print). Its interval: a paired bootstrap, stratified by task (each resample draws every
task's samples with replacement, as many as it has), percentile method, RESAMPLES draws from a fixed seed, so a
rerun on the same scores gives the same interval. Chosen over the t interval because the scores are bounded and
mostly 0/1 (a few tasks give partial credit): the percentile interval stays inside what the scores can reach,
and identical outputs give a zero-width interval at 0.

"Within 1 point" (issue 40): mean difference >= -1 point and the interval's lower end >= -2 points (a point is
1% of accuracy; scores here are fractions, so -0.01 and -0.02).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 10_000
SEED = 0
MEAN_FLOOR = -0.01  # "within 1 point": the mean difference is at least this ...
LOW_FLOOR = -0.02  # ... and the interval's lower end at least this
_EPS = 1e-9  # float slack for the floors: 5 losses in 500 samples is -0.01, within
_CHUNK = 1 << 20  # bootstrap indices drawn per batch (bounds the memory of large samples)
METHOD = (
    f"paired bootstrap stratified by task, percentile {int(100 * CONFIDENCE)}% interval, "
    f"{RESAMPLES} resamples, seed {SEED}"
)


@dataclass(frozen=True)
class PairedDiff:
    """Policy minus reference, in fractions of accuracy (0.01 = 1 point)."""

    n: int  # paired samples
    diff: float  # the mean difference
    diff_low: float  # its interval
    diff_high: float
    better: int  # samples the policy scored higher on than the reference
    worse: int  # ... lower

    @property
    def within_1_point(self) -> bool:
        return within_1_point(self.diff, self.diff_low)

    def to_dict(self) -> dict:
        return {**asdict(self), "within_1_point": self.within_1_point}


def within_1_point(diff: float, low: float) -> bool:
    """Issue 40's criterion on a paired difference (fractions): mean >= -1 point and lower end >= -2 points."""
    return diff >= MEAN_FLOOR - _EPS and low >= LOW_FLOOR - _EPS


def _stratum_means(d: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means of one stratum's differences: [resamples]."""
    n = len(d)
    rows = max(1, _CHUNK // n)
    out = np.empty(resamples)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        out[start:stop] = d[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return out


def paired_diff(
    ref: Sequence[float],
    scores: Sequence[float],
    strata: Sequence[str] | None = None,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> PairedDiff:
    """Mean of `scores - ref` (sample i of one against sample i of the other) over the strata's means, with its
    bootstrap interval (module docstring). `strata`: each sample's group (its task); None: one group."""
    a, b = np.asarray(ref, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores need equal 1-D shapes, got {a.shape} and {b.shape}")
    if not len(a):
        raise ValueError("no paired samples")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    labels = np.zeros(len(a), dtype=np.int64)
    if strata is not None:
        if len(strata) != len(a):
            raise ValueError(f"{len(strata)} strata labels for {len(a)} samples")
        _, labels = np.unique(np.asarray(list(strata)), return_inverse=True)
    d = b - a
    groups = [d[labels == k] for k in range(labels.max() + 1)]
    mean = float(np.mean([g.mean() for g in groups]))
    rng = np.random.default_rng(seed)
    boot = np.mean([_stratum_means(g, resamples, rng) for g in groups], axis=0)
    tail = 100 * (1 - confidence) / 2
    low, high = (float(x) for x in np.percentile(boot, [tail, 100 - tail]))
    # Clamped so the interval holds the estimate even where resampled means round differently (constant d).
    return PairedDiff(len(d), mean, min(low, mean), max(high, mean), int((d > 0).sum()), int((d < 0).sum()))


def compare_rows(ref_rows: list[dict], rows: list[dict], length: int | None = None) -> PairedDiff:
    """The paired difference of two policies' harness rows ({"task", "length", "answer", "correct"}, in the same
    order), restricted to one prompt length if given; stratified by task. Raises if the rows do not pair up."""
    if len(ref_rows) != len(rows):
        raise ValueError(f"cannot pair {len(rows)} rows with the reference's {len(ref_rows)}")
    ref, pol, strata = [], [], []
    for i, (r, p) in enumerate(zip(ref_rows, rows)):
        key_r = (r["task"], r["length"], r["answer"])
        if key_r != (p["task"], p["length"], p["answer"]):
            raise ValueError(f"row {i} is not the same sample: {key_r} vs {(p['task'], p['length'], p['answer'])}")
        if length is None or r["length"] == length:
            ref.append(r["correct"])
            pol.append(p["correct"])
            strata.append(r["task"])
    return paired_diff(ref, pol, strata)


def format_paired(entries: list[dict]) -> str:
    """The table of `entries` (PairedDiff.to_dict() plus policy, length, accuracy, ppl_ratio, tokens_attended;
    fractions), in points."""
    w = max([8] + [len(e["policy"]) + 2 for e in entries])
    head = (
        f"{'policy':<{w}}{'length':>7}{'n':>6}{'tokens':>8}{'accuracy':>10}{'diff':>8}{'95% interval':>17}"
        f"{'better/worse':>14}{'ppl/dense':>11}  within 1 point"
    )
    lines = [head]
    for e in entries:
        ppl = "-" if e.get("ppl_ratio") is None else f"{e['ppl_ratio']:.4f}"
        tok = "-" if e.get("tokens_attended") is None else f"{e['tokens_attended']:.0f}"
        interval = f"[{100 * e['diff_low']:+.1f}, {100 * e['diff_high']:+.1f}]"
        lines.append(
            f"{e['policy']:<{w}}{e['length']:>7}{e['n']:>6}{tok:>8}{100 * e['accuracy']:>10.1f}"
            f"{100 * e['diff']:>+8.1f}{interval:>17}{str(e['better']) + '/' + str(e['worse']):>14}{ppl:>11}  "
            + ("yes" if e["within_1_point"] else "no")
        )
    return "\n".join(lines)


def _mean_over_tasks(rows: list[dict]) -> float:
    by_task: dict[str, list[float]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r["correct"])
    return float(np.mean([np.mean(v) for v in by_task.values()]))


def paired_report(
    rows_by_policy: dict[str, list[dict]],
    lengths: list[int],
    ppl: dict[str, dict] | None = None,
    attended: dict[str, dict] | None = None,
    ref: str = "dense",
) -> list[dict]:
    """One entry per (policy other than `ref`, length): the harness's rows paired with the reference's (same
    prompts, same order), the policy's accuracy (mean over tasks), the paired difference and its interval, the
    verdict, and the perplexity ratio and tokens attended the harness measured (None where it did not)."""
    ppl, attended = ppl or {}, attended or {}
    out = []
    for pol, rows in rows_by_policy.items():
        if pol == ref:
            continue
        for n in lengths:
            part = [r for r in rows if r["length"] == n]
            if not part:
                continue
            p = ppl.get(pol, {}).get(str(n), {}).get("ppl")
            pb = ppl.get(ref, {}).get(str(n), {}).get("ppl")
            out.append(
                {
                    "policy": pol,
                    "length": n,
                    "accuracy": _mean_over_tasks(part),
                    "dense_accuracy": _mean_over_tasks([r for r in rows_by_policy[ref] if r["length"] == n]),
                    **compare_rows(rows_by_policy[ref], rows, n).to_dict(),
                    "ppl_ratio": p / pb if p is not None and pb else None,
                    "tokens_attended": attended.get(pol, {}).get(str(n)),
                }
            )
    return out
