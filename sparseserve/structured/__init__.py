"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, a choice of
strings or a grammar (SamplingParams.structured_outputs), through llguidance (the `structured` extra).

backend.py compiles a constraint once per tokenizer and constraint (cached) and gives each sequence its own
matcher (matcher.py); bitmask.py fills the batch's token masks on the host, which the sampler applies on the
device (layers/logits_processors.py). Design and costs: docs/structured_outputs.md."""

from sparseserve.structured.backend import Grammar, GuidanceBackend, structured_backend
from sparseserve.structured.matcher import GrammarMatcher

__all__ = ["Grammar", "GrammarMatcher", "GuidanceBackend", "structured_backend"]
