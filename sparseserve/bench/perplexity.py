"""Decode-step perplexity: teacher-forced continuation scoring in which every scored token is produced by a decode
step, so its attention goes through the engine's decode policy (a prefill attends densely under every policy).

Each window of the essays is split into a prefix of L tokens and N + 1 targets. The engine prefills the prefix
(the prefill's prediction of target 0 is forced but not scored) and then runs N decode steps; the token each step
appends is the next target, whatever the sampler picked, and the log-probability the model gave that target is
recorded. The engine's own scheduling, batching, CUDA graphs and sparse backend run unchanged: `TeacherForcing`
is the engine's profiler (sparseserve/profiler.py), which sees each step's logits and names the tokens to append.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sparseserve.workloads.tasks import TaskBuilder
from sparseserve.profiler import Profiler


@dataclass
class Window:
    prefix_ids: list[int]
    target_ids: list[int]  # target 0 is forced after the prefill, unscored; targets 1.. are scored


def essay_windows(builder: TaskBuilder, prefix_len: int, num_tokens: int, num_windows: int, seed: int) -> list[Window]:
    """`num_windows` slices of the essays (each from a random sentence start), `prefix_len` tokens of context
    (the tokenizer's BOS first, if it has one) then num_tokens + 1 targets."""
    rng = np.random.default_rng([seed, 7919, prefix_len, num_tokens])
    out = []
    bos = list(builder.bos)
    for _ in range(num_windows):
        ids, _ = builder.essays.slice(rng, prefix_len - len(bos) + num_tokens + 1)
        ids = bos + [int(t) for t in ids]
        out.append(Window(ids[:prefix_len], ids[prefix_len:]))
    return out


@dataclass
class ForcedRun:
    logprobs: dict[str, list[float]] = field(default_factory=dict)  # request id -> scored targets' logprobs
    decode_scored: int = 0  # scored tokens whose logits came from a decode step
    other_scored: int = 0  # scored tokens whose logits came from a prefill (a recomputed, preempted sequence)


class TeacherForcing(Profiler):
    """The engine's profiler (`LLM(model, profiler=TeacherForcing())`): the engine appends each registered
    request's next target instead of its sampled token, and the log-probability of the targets from `score_from`
    on is recorded (the full softmax of the step's logits, before any sampling transform)."""

    def __init__(self, score_from: int = 1) -> None:
        self.targets: dict[str, list[int]] = {}
        self.score_from = score_from
        self.run = ForcedRun()
        self._decoding: set[int] = set()

    def on_schedule(self, out: Any) -> None:
        self._decoding = {id(s) for s, n in out.scheduled if n == 1 and s.num_computed_tokens >= s.num_prompt_tokens}

    def on_logits(self, seqs: list, logits: torch.Tensor) -> torch.Tensor | None:
        rows, tokens = [], []
        for i, seq in enumerate(seqs):
            target = self.targets.get(seq.request_id)
            k = seq.num_output_tokens
            if target is not None and k < len(target):
                rows.append(i)
                tokens.append(target[k])
        if not rows:
            return None
        idx = torch.tensor(rows, device=logits.device)
        tok = torch.tensor(tokens, device=logits.device)
        picked = logits[idx].float()
        picked = (picked.gather(1, tok[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)).tolist()
        for i, lp in zip(rows, picked):
            seq = seqs[i]
            if seq.num_output_tokens >= self.score_from:
                if id(seq) in self._decoding:
                    self.run.decode_scored += 1
                else:
                    self.run.other_scored += 1
                self.run.logprobs.setdefault(seq.request_id, []).append(lp)
        forced = torch.full((len(seqs),), -1, dtype=torch.int64, device=logits.device)
        forced[idx] = tok
        return forced


def forced_logprobs(llm: Any, tf: TeacherForcing, windows: list[Window]) -> list[list[float]]:
    """Log-probabilities of each window's targets 1..N, every one computed by a decode step (all windows in one
    batch; the engine schedules them). `llm` was built with `tf` as its profiler. Raises if a preempted sequence
    had a target scored by a prefill."""
    from sparseserve import SamplingParams

    engine = llm.llm_engine
    ids = [f"ppl-{i}" for i in range(len(windows))]
    tf.run = ForcedRun()
    for rid, w in zip(ids, windows):
        tf.targets[rid] = w.target_ids
        engine.add_request(
            rid, w.prefix_ids, SamplingParams(temperature=0.0, max_tokens=len(w.target_ids), ignore_eos=True)
        )
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
    for rid in ids:
        del tf.targets[rid]
    if tf.run.other_scored:
        raise RuntimeError(
            f"{tf.run.other_scored} scored tokens came from a recomputing prefill (preemption): "
            f"give the engine more KV memory or fewer windows"
        )
    return [tf.run.logprobs.get(rid, []) for rid in ids]


def summarize(logprobs: list[list[float]]) -> dict[str, float]:
    """Mean negative log-likelihood per scored token (nats) and its perplexity."""
    flat = [x for row in logprobs for x in row]
    if not flat:
        return {"nll": float("nan"), "ppl": float("nan"), "tokens": 0}
    nll = -sum(flat) / len(flat)
    return {"nll": nll, "ppl": math.exp(nll), "tokens": len(flat)}


def reference_logprobs(model: Any, windows: list[Window]) -> list[list[float]]:
    """The same targets scored by a transformers model in one teacher-forced forward pass per window (the
    check of the engine path for dense attention)."""
    out = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w.prefix_ids + w.target_ids[:-1]], device=model.device)
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            pos = torch.arange(len(w.prefix_ids), ids.shape[1], device=lp.device)
            tgt = torch.tensor(w.target_ids[1:], device=lp.device)
            out.append(lp[pos, tgt].tolist())
    return out
