"""Per-request sampling parameters, with vLLM's field names and validation."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# vLLM's thresholds: below SAMPLING_EPS a temperature is greedy; a temperature between the two is raised to
# MIN_TEMPERATURE, since logits / t overflow to inf (and softmax to NaN) as t approaches 0.
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# torch.Generator seeds are 64-bit; vLLM accepts the signed range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


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
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint of the output (structured/ compiles it).
    json: a JSON schema (dict or its text); json_object: any JSON object; regex; choice: one of the strings;
    grammar: a Lark or GBNF grammar. disable_any_whitespace (vLLM's name): False lets a JSON output hold
    whitespace between its tokens (bounded); True or None (unset, unlike vLLM) writes ", " and ": " only."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParameterError(
                f"structured_outputs takes exactly one of {', '.join(self.KINDS)}; got {', '.join(given) or 'none'}",
                "structured_outputs",
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ParameterError(
                    f"structured_outputs.json is not valid JSON: {e}", "structured_outputs.json"
                ) from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ParameterError("structured_outputs.json must be a JSON schema object", "structured_outputs.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParameterError(
                    f"structured_outputs.{name} must be a non-empty string", f"structured_outputs.{name}"
                )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ParameterError(
                "structured_outputs.choice must be a non-empty list of non-empty strings", "structured_outputs.choice"
            )

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint (compiled grammars are cached by it)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace is False], sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives returned with each sampled token
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # OpenAI's penalties on the output's tokens (presence: once per token seen, frequency: per occurrence) and
    # vLLM's repetition penalty on the prompt's and output's tokens (> 1 discourages; 1 is off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings ignored, before this many
    prompt_logprobs: int | None = None  # logprobs of each prompt token with this many alternatives
    structured_outputs: StructuredOutputsParams | None = None
    stop_strs: list[str] = field(init=False, repr=False)
    # EOS and stop_token_ids, what min_tokens masks: set by the engine when it accepts the request
    all_stop_token_ids: set[int] = field(init=False, repr=False, default_factory=set)

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
            logger.warning(
                "temperature %s is below %s, where logits / temperature overflow; using %s",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
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
        self._check_logits_fields(bad)

    # vLLM's ranges (OpenAI's for the two penalties)
    MAX_PENALTY = 2.0
    MAX_BIAS = 100.0

    def _check_logits_fields(self, bad: Any) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -self.MAX_PENALTY <= v <= self.MAX_PENALTY:
                bad(name, f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            bad("repetition_penalty", f"repetition_penalty must be a finite number > 0, got {r!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "logit_bias must map token ids to numbers")
            bias = {}
            for t, v in self.logit_bias.items():
                tid = int(t) if isinstance(t, str) and t.strip().isdigit() else t
                if not is_int(tid) or tid < 0:
                    bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
                if not _is_real(v) or not math.isfinite(v):
                    bad("logit_bias", f"logit_bias values must be finite numbers, got {v!r} for {t!r}")
                bias[tid] = max(-self.MAX_BIAS, min(self.MAX_BIAS, float(v)))
            self.logit_bias = bias or None
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        pl = self.prompt_logprobs
        if pl is not None and (not is_int(pl) or not 0 <= pl <= self.MAX_LOGPROBS):
            bad("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {self.MAX_LOGPROBS}], got {pl!r}")
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                bad("structured_outputs", f"structured_outputs: {e}")
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            bad("structured_outputs", "structured_outputs must be a StructuredOutputsParams")

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

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
