"""LongBench v1's request mix as a synthetic workload (`bench serve --dataset longbench`): the paper's serving
load without its text.

Each request picks one of the ten datasets in proportion to its sample count; its prompt length is drawn from
that dataset's length distribution, a two-piece log-normal through the measured p10 / p50 / p90 (log-scale
spreads below and above the median: the three quantiles hold exactly), clipped to [1, max]. Lengths are
Llama-3 tokens; `tokenizer="llama2"` multiplies each dataset's by its measured Llama-2 / Llama-3 ratio (LWM-7B
uses the Llama-2 tokenizer). The output length is the dataset's `dataset2maxlen` (with ignore_eos) or, with
`output="mean"`, the mean length a real model generated. A cap on the prompt cuts its middle, as LongBench does
(workloads/datasets.py `cut_middle`). docs/benchmarks/serving.md shows how to run the paper's figures with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z90 = 1.2815515655446004  # the standard normal's 0.9 quantile


@dataclass(frozen=True)
class Dataset:
    name: str
    samples: int
    p10: int  # prompt tokens (Llama-3)
    p50: int
    p90: int
    max: int
    llama2_ratio: float  # Llama-2 tokens / Llama-3 tokens of the same text
    max_gen: int  # LongBench's dataset2maxlen
    mean_gen: int  # mean generated tokens of a real model

    def sigmas(self) -> tuple[float, float]:
        """Log-scale spreads below and above the median."""
        return math.log(self.p50 / self.p10) / Z90, math.log(self.p90 / self.p50) / Z90


# Per-sample lengths of LongBench's own prediction files, converted with measured tokenizer ratios (issue 38).
DATASETS = (
    Dataset("qasper", 200, 2900, 5100, 7300, 21400, 1.19, 128, 20),
    Dataset("narrativeqa", 200, 11100, 24600, 41600, 51100, 1.15, 128, 9),
    Dataset("multifieldqa_en", 150, 2100, 7300, 11000, 15000, 1.18, 64, 18),
    Dataset("dureader", 200, 9000, 12900, 17300, 22500, 1.77, 128, 93),
    Dataset("gov_report", 200, 4400, 9900, 19900, 56800, 1.15, 512, 454),
    Dataset("qmsum", 200, 6800, 14300, 27600, 34500, 1.15, 512, 100),
    Dataset("multi_news", 200, 1150, 2360, 5270, 15400, 1.17, 512, 439),
    Dataset("vcsum", 200, 4200, 11100, 23400, 35000, 1.77, 512, 386),
    Dataset("lcc", 500, 1250, 1940, 4770, 21900, 1.26, 64, 64),
    Dataset("repobench-p", 500, 3180, 7650, 16500, 40900, 1.27, 64, 64),
)
TOKENIZERS = ("llama3", "llama2")
OUTPUTS = ("max", "mean")


@dataclass(frozen=True)
class Request:
    dataset: str
    full_len: int  # the prompt's length before the cap
    prompt_len: int  # after the cap
    output_len: int


def draw_lengths(d: Dataset, n: int, rng: np.random.Generator, ratio: float = 1.0) -> np.ndarray:
    """n prompt lengths of dataset d (int64), scaled by `ratio` (the tokenizer's), before any cap."""
    lo, hi = d.sigmas()
    z = rng.standard_normal(n)
    x = np.exp(math.log(d.p50) + z * np.where(z < 0, lo, hi)) * ratio
    return np.clip(np.rint(x), 1, round(d.max * ratio)).astype(np.int64)


def sample_requests(
    n: int,
    seed: int,
    tokenizer: str = "llama3",
    max_input_len: int | None = None,
    output: str = "max",
    output_len: int | None = None,
) -> list[Request]:
    """n requests of the mix, reproducible by seed; output_len: every request asks for that many tokens."""
    if tokenizer not in TOKENIZERS or output not in OUTPUTS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS} and output one of {OUTPUTS}")
    if max_input_len is not None and max_input_len < 1:
        raise ValueError(f"max_input_len must be >= 1, got {max_input_len}")
    rng = np.random.default_rng([seed, 38])
    weights = np.array([d.samples for d in DATASETS], dtype=np.float64)
    which = rng.choice(len(DATASETS), size=n, p=weights / weights.sum())
    lengths = np.zeros(n, dtype=np.int64)
    for i, d in enumerate(DATASETS):  # one draw per dataset, in table order: the seed fixes every length
        mask = which == i
        lengths[mask] = draw_lengths(d, int(mask.sum()), rng, d.llama2_ratio if tokenizer == "llama2" else 1.0)
    out = []
    for i, full in zip(which.tolist(), lengths.tolist()):
        d = DATASETS[i]
        gen = output_len or (d.max_gen if output == "max" else d.mean_gen)
        out.append(Request(d.name, full, min(full, max_input_len or full), gen))
    return out
