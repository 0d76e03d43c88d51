"""Incremental detokenization and stop conditions for one sequence."""
from __future__ import annotations

from collections.abc import Callable

from sparseserve.engine.request import Sequence


# Every pattern transformers' clean-up (`clean_up_tokenization`) rewrites, each with a space before it.
_CLEAN_UP_PROBE = "Hi . a ? b ! c , d ' e n't f 'm g 's h 've i 're j"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode(ids, skip_special_tokens=True). A fast tokenizer's decode is its backend's
    text, then transformers' clean-up where that applies (it depends on the tokenizer and the transformers
    version: a probe text that every clean-up rule changes tells which); calling the backend directly skips
    transformers' argument conversion: two decodes per sequence per step, about 30 us each through transformers,
    are a large part of a large batch's step on a small model."""
    slow = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return slow
    fast = lambda ids: backend.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return fast
    ids = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
    plain, full = fast(ids), slow(ids)
    clean_up = tokenizer.clean_up_tokenization
    if clean_up(plain) == plain:  # the probe does not show the clean-up (its spaces did not survive)
        return slow
    if full == plain:
        return fast
    if full == clean_up(plain):
        return lambda ids: clean_up(backend.decode(ids, skip_special_tokens=True))
    return slow


def detokenize_incrementally(decode: Callable[[list[int]], str], seq: Sequence) -> str:
    """Decodes the newest tokens against a few tokens of context, so multi-byte characters and
    leading spaces come out right; holds text back while it ends in an incomplete character.
    decode: text_decoder's function."""
    ids = seq.token_ids
    prefix = decode(ids[seq.prefix_offset:seq.read_offset])
    full = decode(ids[seq.prefix_offset:])
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix):]
    return ""


def check_stop(seq: Sequence, new_text: str, eos_token_ids: set[int], max_model_len: int) -> None:
    """Sets finish_reason/stop_reason (vLLM semantics); trims a matched stop string from the text."""
    p = seq.params
    token = seq.token_ids[-1]
    if not p.ignore_eos and token in eos_token_ids:
        seq.finish_reason = "stop"
        return
    if token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        return
    if p.stop_strs and new_text:
        # Only the tail can hold a new match: the new text plus a stop string's length of context.
        window = len(new_text) + max(len(s) for s in p.stop_strs)
        start = max(len(seq.output_text) - window, 0)
        for stop in p.stop_strs:
            at = seq.output_text.find(stop, start)
            if at != -1:
                cut = at + len(stop) if p.include_stop_str_in_output else at
                seq.output_text = seq.output_text[:cut]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
    if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
