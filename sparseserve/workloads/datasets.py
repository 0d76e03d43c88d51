"""Prompts for benchmarks and accuracy tasks, built from the essays in ../shared/data/haystack, and
request traces from ../shared/data/traces (Mooncake format).

With a tokenizer, lengths are exact: `len(tokenizer.encode(text, add_special_tokens=False))` equals
the requested length. Without one, text is cut by a measured characters-per-token ratio.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for 512 prompt tokens
# Where a trace block may start and end: a single space before a letter, after a non-space character. Byte-level
# BPE pre-tokenizers (GPT-2's and Llama 3's) always split there, so the block tokenizes the same alone and inside
# any prompt, and equal hash ids give equal token ids.
_BLOCK_EDGE = re.compile(r"(?<=\S) (?=[^\W\d_])")
_FILLERS = (" the", " a", " and", " of")


def data_dir() -> Path:
    """../shared/data relative to the project root; $SPARSESERVE_DATA_DIR overrides it."""
    env = os.environ.get("SPARSESERVE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


@lru_cache(maxsize=1)
def haystack_corpus() -> str:
    """All essays, in file-name order, separated by blank lines."""
    folder = data_dir() / "haystack"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no haystack essays in {folder} (set SPARSESERVE_DATA_DIR)")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


_CORPUS_IDS: dict[int, tuple[Any, list[int]]] = {}  # id(tokenizer) -> (tokenizer, ids); keeps it alive


def _corpus_ids(tokenizer: Any) -> list[int]:
    entry = _CORPUS_IDS.get(id(tokenizer))
    if entry is None:
        entry = _CORPUS_IDS[id(tokenizer)] = (tokenizer, tokenizer.encode(haystack_corpus(), add_special_tokens=False))
    return entry[1]


def haystack_token_ids(tokenizer: Any, num_tokens: int, seed: int | str) -> list[int]:
    """`num_tokens` consecutive corpus tokens from a seeded start (wrapping around the corpus)."""
    ids = _corpus_ids(tokenizer)
    start = random.Random(seed).randrange(len(ids))
    reps = (start + num_tokens) // len(ids) + 1
    return (ids * reps)[start : start + num_tokens] if reps > 1 else ids[start : start + num_tokens]


def fit_text(tokenizer: Any, ids: list[int], seed: int | str = 0) -> str:
    """Text that re-tokenizes to exactly len(ids) tokens, starting with the text of `ids`.

    Decoding then re-encoding may merge or split tokens where pieces meet; the tail is trimmed or
    topped up with more haystack tokens until the count matches (a few rounds at most)."""
    target = len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for round_ in range(8):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == target:
            return text
        if len(got) > target:
            got = got[:target]
        else:
            got = got + haystack_token_ids(tokenizer, target - len(got), f"{seed}:fill:{round_}")
        text = tokenizer.decode(got, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text  # pathological tokenizer: within a token or two of the target


def cut_middle(items: Any, keep: int) -> Any:
    """The first keep // 2 and the last keep - keep // 2 items of a list or string (LongBench's truncation)."""
    if len(items) <= keep:
        return items
    head = keep // 2
    return items[:head] + items[len(items) - (keep - head) :]


def haystack_text(tokenizer: Any, num_tokens: int, seed: int | str = 0) -> str:
    """Natural filler text of exactly `num_tokens` tokens (without special tokens), reproducible by seed."""
    return fit_text(tokenizer, haystack_token_ids(tokenizer, num_tokens, seed), seed)


class PromptBuilder:
    """Prompts of given token lengths: exact with a tokenizer, else `chars_per_token` approximations."""

    def __init__(self, tokenizer: Any | None = None, chars_per_token: float | None = None) -> None:
        if tokenizer is None and chars_per_token is None:
            raise ValueError("PromptBuilder needs a tokenizer or a chars_per_token ratio")
        self.tokenizer, self.chars_per_token = tokenizer, chars_per_token
        # A prompt of n tokens is what the server counts: text of n minus the special tokens (BOS)
        # that the tokenizer adds on encode.
        self.num_special = len(tokenizer.encode("", add_special_tokens=True)) if tokenizer is not None else 0
        self._blocks: dict[tuple, str] = {}  # (hash id, seed) -> trace block text

    def _chars(self, num_tokens: int, seed: int | str) -> str:
        corpus = haystack_corpus()
        n = max(1, round(num_tokens * self.chars_per_token))
        start = random.Random(seed).randrange(len(corpus))
        return (corpus * (n // len(corpus) + 2))[start : start + n]

    def prompt(self, num_tokens: int, seed: int | str, keep: int | None = None) -> str:
        """keep: the text of num_tokens cut to keep tokens in the middle (`cut_middle`)."""
        if self.tokenizer is None:
            text = self._chars(num_tokens, seed)
            return text if keep is None else cut_middle(text, max(1, round(keep * self.chars_per_token)))
        ids = haystack_token_ids(self.tokenizer, max(1, num_tokens - self.num_special), seed)
        if keep is not None:
            ids = cut_middle(ids, max(1, keep - self.num_special))
        return fit_text(self.tokenizer, ids, seed)

    def trace_block(self, hash_id: int | str, seed: int | str) -> str:
        """The text of one trace block: exactly TRACE_BLOCK_TOKENS tokens, tokenized the same alone and inside
        any prompt (it starts and ends at a pre-tokenizer boundary, `_BLOCK_EDGE`), so prompts sharing hash ids
        share token ids. Haystack words up to the last boundary that fits, topped up with a one-token word."""
        key = (hash_id, seed)
        if key in self._blocks:
            return self._blocks[key]
        tok = self.tokenizer
        text = tok.decode(
            haystack_token_ids(tok, 2 * TRACE_BLOCK_TOKENS, f"{seed}:block:{hash_id}"),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
        edges = [m.start() for m in _BLOCK_EDGE.finditer(text)]
        text = text[edges[0] :] if edges else " " + text.strip()
        edges = [e - edges[0] for e in edges] if edges else []
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = [a for a, _ in enc["offset_mapping"]]
        fit = [e for e in edges if bisect.bisect_left(starts, e) <= TRACE_BLOCK_TOKENS] or [len(text)]
        block = text[: fit[-1]].rstrip()
        n = len(tok.encode(block, add_special_tokens=False))
        filler = next((f for f in _FILLERS if len(tok.encode(f, add_special_tokens=False)) == 1), _FILLERS[0])
        block += filler * max(TRACE_BLOCK_TOKENS - n, 0)
        ids = tok.encode(block, add_special_tokens=False)
        if len(ids) != TRACE_BLOCK_TOKENS:  # an unusual tokenizer: exact length, sharing at word boundaries
            block = fit_text(tok, ids[:TRACE_BLOCK_TOKENS], f"{seed}:block:{hash_id}")
        self._blocks[key] = block
        return block

    def trace_prompt(self, hash_ids: list[int], num_tokens: int, seed: int | str) -> str:
        """Equal hash ids give equal 512-token text blocks (`trace_block`), so the trace's shared prefixes are
        shared token for token by the server's tokenizer; `num_tokens` cuts the last block (past the hash ids:
        request-specific blocks). Without a tokenizer the blocks are equal text of approximate length, and
        tokens may differ where blocks meet."""
        tail_seed = f"{seed}:tail:{','.join(map(str, hash_ids))}:{num_tokens}"
        if self.tokenizer is None:
            block_seed = [f"{seed}:block:{h}" for h in hash_ids]
            text = "".join(self._chars(TRACE_BLOCK_TOKENS, s) for s in block_seed)
            want = round(num_tokens * self.chars_per_token)
            return (text + self._chars(num_tokens, tail_seed))[:want]
        num_tokens = max(1, num_tokens - self.num_special)
        full, rem = divmod(num_tokens, TRACE_BLOCK_TOKENS)
        ids = list(hash_ids) + [f"{tail_seed}:{i}" for i in range(max(0, full + 1 - len(hash_ids)))]
        text = "".join(self.trace_block(h, seed) for h in ids[:full])
        if rem:
            cut = self.tokenizer.encode(self.trace_block(ids[full], seed), add_special_tokens=False)[:rem]
            text += fit_text(self.tokenizer, cut, tail_seed)
        return text


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the start of the replay, already time-scaled
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: str | Path,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
) -> list[TraceRequest]:
    """The first `num_requests` records of a Mooncake trace. `time_scale` multiplies the gaps between
    arrivals (0.1 = ten times faster); lengths are capped, and hash ids beyond the cap dropped."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if num_requests is not None and len(out) >= num_requests:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            n_in = rec["input_length"] if max_input_len is None else min(rec["input_length"], max_input_len)
            n_out = rec["output_length"] if max_output_len is None else min(rec["output_length"], max_output_len)
            blocks = -(-n_in // TRACE_BLOCK_TOKENS)
            out.append(
                TraceRequest(
                    rec["timestamp"] / 1000.0, max(1, n_in), max(1, n_out), tuple(rec.get("hash_ids", []))[:blocks]
                )
            )
    t0 = out[0].arrival_s if out else 0.0
    return [TraceRequest((r.arrival_s - t0) * time_scale, r.input_length, r.output_length, r.hash_ids) for r in out]
