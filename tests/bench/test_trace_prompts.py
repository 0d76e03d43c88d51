"""Trace prompts (workloads/datasets.py): equal Mooncake hash ids give equal token ids through the tokenizer, so the
trace's real prefix sharing reaches a server's prefix cache; prompt lengths stay exact."""

from __future__ import annotations

import pytest

from sparseserve.workloads.datasets import TRACE_BLOCK_TOKENS, PromptBuilder, data_dir, load_trace
from sparseserve.models.loader import DEFAULT_MODEL_DIR

TRACE = data_dir() / "traces" / "mooncake_conversation.jsonl"
pytestmark = pytest.mark.skipif(
    not (data_dir() / "haystack").is_dir(), reason=f"benchmark data not found at {data_dir()} (../shared/data)"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_blocks_tokenize_alone_as_inside_prompts(tokenizer):
    builder = PromptBuilder(tokenizer)
    for h in range(12):
        block = builder.trace_block(h, seed=1)
        assert len(tokenizer.encode(block, add_special_tokens=False)) == TRACE_BLOCK_TOKENS
        assert block[0] == " " and not block[-1].isspace()
    ids = [tokenizer.encode(builder.trace_block(h, 1), add_special_tokens=False) for h in (3, 9, 4)]
    whole = tokenizer.encode("".join(builder.trace_block(h, 1) for h in (3, 9, 4)), add_special_tokens=False)
    assert whole == ids[0] + ids[1] + ids[2]
    assert builder.trace_block(3, 1) != builder.trace_block(3, 2)  # the seed changes the text


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not found")
def test_trace_requests_share_token_prefixes_by_hash_ids(tokenizer):
    """Requests of the trace's first 400 that share more than their first hash id with an earlier one (the
    conversations' later turns), and the first 20 (which share block 0), inputs capped at 3K: each prompt has
    its exact length (BOS counted, as a server counts it), and any two share at least BOS + 512 tokens per
    leading hash id in common (where one ends inside a common block: everything up to its end)."""
    builder = PromptBuilder(tokenizer)
    trace = load_trace(TRACE, 400, max_input_len=3000)
    picked = set(range(20))
    for i in range(len(trace)):
        for j in range(i):
            if shared(list(trace[i].hash_ids), list(trace[j].hash_ids)) > 1:
                picked |= {i, j}
    assert len(picked) > 40  # the conversation trace shares multi-block prefixes
    trace = [trace[i] for i in sorted(picked)]
    ids = [tokenizer.encode(builder.trace_prompt(list(t.hash_ids), t.input_length, seed=0)) for t in trace]
    assert [len(x) for x in ids] == [t.input_length for t in trace]
    for i in range(len(trace)):
        for j in range(i):
            common = shared(list(trace[i].hash_ids), list(trace[j].hash_ids))
            if common:
                want = 1 + min(common * TRACE_BLOCK_TOKENS, len(ids[i]) - 1, len(ids[j]) - 1)
                assert shared(ids[i], ids[j]) >= want, (i, j)
