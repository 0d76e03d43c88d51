"""One sequence's grammar state: it consumes the sequence's output tokens as they land and tells the next
token's mask."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)
PLACEHOLDER = -1  # engine/overlap.py's: a token still on the device


class GrammarMatcher:
    """Follows a sequence's output by count (`advance` is idempotent: the runner may advance it to a token
    before the engine appends it, under async scheduling)."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher  # llguidance.LLMatcher
        self.consumed = 0  # output tokens consumed

    def advance(self, token_ids: list[int], num_prompt_tokens: int, tail: int | None = None) -> None:
        """Consumes the output tokens not consumed yet; a trailing placeholder stands for `tail` (or stops it)."""
        start = num_prompt_tokens + self.consumed
        new = token_ids[start:]
        if not new:
            return
        if new[-1] == PLACEHOLDER:
            new = new[:-1] if tail is None else new[:-1] + [tail]
        if new and not self.matcher.is_error():
            if not self.matcher.consume_tokens(new):
                logger.error("a sampled token broke its grammar: %s", self.matcher.get_error())
        self.consumed += len(new)

    @property
    def is_stopped(self) -> bool:
        """The constraint is complete and allows no more tokens (nor does an error state)."""
        return self.matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()
