"""The token masks of a step's constrained sequences: matchers advanced to each sequence's newest token, masks
filled on the host in parallel (llguidance's executor, outside the GIL), then copied to the device."""

from __future__ import annotations

from typing import Any

import torch

_EXECUTOR: Any = None


def _executor() -> Any:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def fill_bitmask(seqs: list[Any], tails: dict[int, int] | None, vocab_size: int, device: torch.device) -> torch.Tensor:
    """int32 [len(seqs), ceil(vocab / 32)] on `device`: bit t of row i allows token t for seqs[i] (a Sequence
    with a `grammar`). tails[i]: the value of seqs[i]'s trailing placeholder (async scheduling)."""
    tails = tails or {}
    for i, seq in enumerate(seqs):
        seq.grammar.advance(seq.token_ids, len(seq.prompt_token_ids), tails.get(i))
    words = (vocab_size + 31) // 32
    # pinned: the copy below does not wait for the device's queue (the caching host allocator keeps the buffer
    # until the copy has run)
    host = torch.empty(len(seqs), words, dtype=torch.int32, pin_memory=device.type == "cuda")
    # (llguidance.torch's wrapper of this call imports torch.compile's machinery: seconds at the first mask)
    _executor().unsafe_compute_mask_ptr(
        [(s.grammar.matcher, i) for i, s in enumerate(seqs)], host.data_ptr(), words * 4, len(seqs)
    )
    return host.to(device, non_blocking=True)
