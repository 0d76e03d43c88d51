"""Incremental detokenization and stop conditions for one sequence."""

from __future__ import annotations

from collections.abc import Callable

from sparseserve.engine.request import Sequence

# Every pattern transformers' `clean_up_tokenization` rewrites, each with a space before it.
_CLEAN_UP_PROBE = "Hi . a ? b ! c , d ' e n't f 'm g 's h 've i 're j"


def _plan(tokenizer) -> tuple[Callable[[list[int]], str], object | None]:
    """(ids -> text as tokenizer.decode(ids, skip_special_tokens=True), the tokenizers backend when
    that decode is the backend's alone, else None). Whether transformers' clean-up applies depends
    on the tokenizer and its version: a probe text tells (docs/engine.md, "Detokenization")."""
    slow = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return slow, None
    fast = lambda ids: backend.decode(ids, skip_special_tokens=True)  # noqa: E731
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return fast, backend
    ids = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
    plain, full = fast(ids), slow(ids)
    clean_up = tokenizer.clean_up_tokenization
    if clean_up(plain) == plain:  # the probe's spaces did not survive: it shows nothing
        return slow, None
    if full == plain:
        return fast, backend
    if full == clean_up(plain):
        return (lambda ids: clean_up(backend.decode(ids, skip_special_tokens=True))), None
    return slow, None


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode(ids, skip_special_tokens=True) (`_plan`)."""
    return _plan(tokenizer)[0]


def detokenize_incrementally(decode: Callable[[list[int]], str], seq: Sequence) -> str:
    """Decodes the newest tokens against a few tokens of context, so multi-byte characters and
    leading spaces come out right; holds text back while it ends in an incomplete character.
    decode: text_decoder's function."""
    ids = seq.token_ids
    prefix = decode(ids[seq.prefix_offset : seq.read_offset])
    full = decode(ids[seq.prefix_offset :])
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return full[len(prefix) :]
    return ""


class _Stream:
    """A sequence's incremental decode in the tokenizers backend, and how many tokens it took."""

    __slots__ = ("stream", "fed")

    def __init__(self, stream, fed: int) -> None:
        self.stream, self.fed = stream, fed


class Detokenizer:
    """Each step's new text of a sequence, by `detokenize_incrementally`'s rule; through the
    tokenizers backend's `DecodeStream` (the same rule, one call a step) where the decode is the
    backend's alone and the library has it, else the two decodes."""

    def __init__(self, tokenizer) -> None:
        self.decode, self._backend = _plan(tokenizer)
        if self._backend is not None:
            try:
                from tokenizers.decoders import DecodeStream

                DecodeStream(ids=[0], skip_special_tokens=True).step(self._backend, [0])
                self._stream_cls = DecodeStream
            except Exception:  # an older tokenizers: no DecodeStream with context ids or list steps
                self._backend = None

    @property
    def streams(self) -> bool:
        return self._backend is not None

    def __call__(self, seq: Sequence) -> str:
        state: _Stream | bool | None = seq.detok_state
        if self._backend is None or state is False:
            return detokenize_incrementally(self.decode, seq)
        ids = seq.token_ids
        if state is None:
            state = seq.detok_state = _Stream(
                self._stream_cls(ids=ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True),
                seq.read_offset,
            )
        try:
            new = state.stream.step(self._backend, ids[state.fed :])
        except Exception:
            # The stream refuses a decode that does not extend the text before it (byte-level
            # corner cases): the two decodes take this sequence over, from the offsets kept below.
            seq.detok_state = False
            return detokenize_incrementally(self.decode, seq)
        state.fed = len(ids)
        if new is None:
            return ""
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)  # as the decodes' move
        return new


def check_stop(seq: Sequence, new_text: str, eos_token_ids: set[int], max_model_len: int) -> None:
    """Sets finish_reason/stop_reason (vLLM semantics); trims a matched stop string off the text."""
    p = seq.params
    ids = seq.token_ids
    token = ids[-1]
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
    # (the lengths straight from the lists: this runs per sequence and step)
    n = len(ids)
    if (p.max_tokens is not None and n - len(seq.prompt_token_ids) >= p.max_tokens) or n >= max_model_len:
        seq.finish_reason = "length"
