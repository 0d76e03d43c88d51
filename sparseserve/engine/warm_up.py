"""The warm-up's requests (LLMEngine.warm_up; docs/engine.md, "The warm-up")."""

from __future__ import annotations


def warm_up_prompts(
    block_size: int, budget: int, max_model_len: int, num_blocks: int, vocab: int
) -> list[list[list[int]]]:
    """Two rounds of four prompts whose steps meet the step kinds first requests meet (token counts
    multiples of 16 and not: Triton specializes on them), none if the cache is too small. Per round:
    1. short (decodes beside the rest); 2. within the budget but cut by the short one's share (a
    chunk after a prefix: never layer-segmented; round 2: a prefix-cache hit on round 1's, restored
    from the host store under KV offload); 3. longer than the budget (round 2: a hit on round 1's
    first two blocks, which a layer-segmented prefill restores); 4. short again (mid-step)."""
    bs = block_size
    room = (num_blocks // 4 - 2) * bs  # four prompts and outputs fit
    long_len = min(budget + 2 * bs, max_model_len - 13, room)
    if long_len < 2 * bs + 4:
        return []
    rounds = []
    for odd in (0, 1):
        lengths = (2 * bs + 3 * odd, min(budget, long_len) - bs - odd, long_len + 5 * odd, bs + 7 * odd)
        prompts = []
        for i, n in enumerate(lengths):
            start = i * 7919 + (odd * 104729 if i != 1 else 0)
            prompt = [(start + t) % vocab for t in range(n)]
            if i == 2 and odd:
                prompt[: 2 * bs] = [(i * 7919 + t) % vocab for t in range(2 * bs)]
            prompts.append(prompt)
        rounds.append(prompts)
    return rounds
