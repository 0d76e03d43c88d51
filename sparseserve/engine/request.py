"""A sequence: one prompt's stream of tokens (a request with n > 1 owns n sequences)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sparseserve.outputs import Logprob
from sparseserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share blocks
    # Prefix caching: hashes of token_ids' full blocks (kvcache/prefix_cache.py), computed as
    # they fill; how many leading blocks of block_table were offered to the cache; the prompt
    # tokens the cache served at the first admission (vLLM's num_cached_tokens; None before it).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # incremental detokenization (engine/detokenizer.py): offsets, or the backend's stream
    prefix_offset: int = 0
    read_offset: int = 0
    detok_state: object = field(default=None, repr=False)  # None: not started; False: offsets only
    grammar: object = field(default=None, repr=False)  # structured outputs: its GrammarMatcher
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token (runner)
    _table_array: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 6, 0)
        if self.params.logprobs is not None:
            self.logprobs = []

    def block_table_array(self) -> np.ndarray:
        """The block table as int32, rebuilt only when blocks were added: between releases the
        table only grows, so an equal length means equal contents (O(1) per decode step)."""
        if self._table_array is None or len(self._table_array) != len(self.block_table):
            self._table_array = np.asarray(self.block_table, dtype=np.int32)
        return self._table_array

    def release_blocks(self) -> list[int]:
        blocks, self.block_table, self._table_array = self.block_table, [], None
        self.num_cached_blocks = 0
        return blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
