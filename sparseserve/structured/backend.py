"""llguidance behind a small interface: a tokenizer's backend compiles constraints into `Grammar`s (cached by the
constraint's text) and each sequence gets a fresh `GrammarMatcher` of one (a copy of the compiled matcher)."""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from sparseserve.sampling_params import ParameterError, StructuredOutputsParams
from sparseserve.structured.matcher import GrammarMatcher

INSTALL_HINT = "structured outputs need llguidance: pip install 'sparseserve[structured]'"
# With disable_any_whitespace False: the whitespace a JSON output may hold between two of its tokens (a
# pretty-printed object ~10 levels deep fits). Unbounded, a model that prefers whitespace loops until max_tokens;
# unset, none is allowed (docs/structured_outputs.md).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ParameterError(INSTALL_HINT, "structured_outputs") from None
    return llguidance


class Grammar:
    """A compiled constraint: `matcher()` gives a sequence its own matcher in the start state."""

    def __init__(self, template: Any, key: str) -> None:
        self._template, self.key = template, key

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GuidanceBackend:
    """One tokenizer's llguidance state; thread-safe (the server compiles off the engine's thread)."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        llg = self._llg = _llguidance()
        # (a model's EOS past the tokenizer's vocabulary, as in a benchmark's model directory, has no text to match)
        eos = sorted(t for t in eos_token_ids if t < len(tokenizer)) or [tokenizer.eos_token_id]
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:  # a slow tokenizer, or one llguidance cannot read
            raise ParameterError(f"structured outputs cannot use this tokenizer: {e}", "structured_outputs") from None
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The constraint's grammar; ParameterError (param structured_outputs.<kind>) when it is invalid."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        template = self._llg.LLMatcher(self.tokenizer, self._grammar_text(spec), log_level=0)
        if template.is_error():
            raise ParameterError(
                f"invalid {spec.kind} constraint: {template.get_error().strip()}", f"structured_outputs.{spec.kind}"
            )
        grammar = Grammar(template, key)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _grammar_text(self, spec: StructuredOutputsParams) -> str:
        llg, kind = self._llg, spec.kind
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else {"type": "object"}
            options = (
                {"whitespace_pattern": JSON_WHITESPACE}
                if spec.disable_any_whitespace is False
                else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            )
            try:
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
            except (ValueError, TypeError) as e:
                raise ParameterError(f"invalid JSON schema: {e}", "structured_outputs.json") from None
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llg.grammar_from("choice", spec.choice)
        try:  # Lark, or GBNF (llama.cpp's, which vLLM's `grammar` takes) converted to Lark
            return llg.grammar_from("grammar", spec.grammar)
        except ValueError as e:
            raise ParameterError(f"invalid grammar: {e}", "structured_outputs.grammar") from None


_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def structured_backend(engine: Any) -> GuidanceBackend:
    """The backend of an engine's tokenizer, vocabulary (the model's, which may pad the tokenizer's) and EOS
    tokens; built on first use (a second or so for a large vocabulary), shared by the engine and the server."""
    tokenizer = engine.tokenizer
    key = (engine.model_runner.arch.vocab_size, tuple(sorted(engine.eos_token_ids)))
    with _BACKENDS_LOCK:
        per_tokenizer = _BACKENDS.setdefault(tokenizer, {})
        backend = per_tokenizer.get(key)
        if backend is None:
            backend = per_tokenizer[key] = GuidanceBackend(tokenizer, *key[:1], list(key[1]))
    return backend
