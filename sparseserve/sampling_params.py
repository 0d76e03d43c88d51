"""Per-request sampling parameters, with vLLM's field names and validation."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# vLLM's thresholds: below SAMPLING_EPS a temperature is greedy; a temperature between the two is raised to
# MIN_TEMPERATURE, since logits / t overflow to inf (and softmax to NaN) as t approaches 0.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# torch.Generator seeds are 64-bit; vLLM accepts the signed range.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


class ParameterError(ValueError):
    """An invalid request parameter; `param` names it (the `param` of the server's OpenAI error)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_int(x: object) -> bool:
    """A true integer: bool is an int subclass in Python, but True is no token id or count."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0     # 0 (or below 1e-5) means greedy
    top_p: float = 1.0
    top_k: int = -1              # -1 (or 0) disables
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives returned with each sampled token
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stop_strs: list[str] = field(init=False, repr=False)

    # Generous but finite: every sequence of a request holds KV blocks.
    MAX_N = 64
    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise ParameterError(msg, param)

        if not is_int(self.n) or not 1 <= self.n <= self.MAX_N:
            bad("n", f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, where logits / temperature overflow; using %s",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            bad("logprobs", f"logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        self.stop_strs = list(stops)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or any(not is_int(t) or t < 0 for t in ids):
            bad("stop_token_ids", f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_hold(self) -> int:
        """Characters of generated text held back from a stream until the sequence finishes: a stop string
        still being matched may be cut from the end of the text, and text already sent cannot be taken back.
        Read per sequence and step, and derived from `stop_strs` each time (a cached value would go stale if the
        list were changed), so the usual case, no stop string, skips the max over the strings."""
        return max(map(len, self.stop_strs)) - 1 if self.stop_strs else 0
