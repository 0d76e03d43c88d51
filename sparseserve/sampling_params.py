"""Per-request sampling parameters, with vLLM's field names and validation."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0     # 0 means greedy
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
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            bad(f"n must be an integer in [1, {self.MAX_N}], got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            bad("stop must be a non-empty string or a list of non-empty strings")
        self.stop_strs = stops
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
