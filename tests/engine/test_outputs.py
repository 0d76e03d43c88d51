"""The engine's output path: per-step deltas (vLLM's RequestOutputKind.DELTA), folded by the offline API."""

from __future__ import annotations

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.outputs import CompletionOutput, Logprob, RequestOutput


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", block_size=16, max_model_len=256)


def run_steps(llm: LLM, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    engine = llm.llm_engine
    engine.add_request("r", prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o for o in engine.step() if o.request_id == "r"]
    return deltas


def test_deltas_fold_into_the_offline_result(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9, logprobs=2, ignore_eos=True)
    final = llm.generate(["Hello there"], params, use_tqdm=False)[0]
    deltas = run_steps(llm, "Hello there", params)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    for i, ref in enumerate(final.outputs):
        mine = [c for d in deltas for c in d.outputs if c.index == i]
        assert sum(len(c.token_ids) for c in mine) == len(ref.token_ids) == 9
        assert all(len(c.token_ids) == 1 for c in mine)  # one new token per step: no step repeats what was sent
        assert [t for c in mine for t in c.token_ids] == ref.token_ids
        assert "".join(c.text for c in mine) == ref.text
        assert [e for c in mine for e in c.logprobs] == ref.logprobs
        assert mine[-1].cumulative_logprob == ref.cumulative_logprob
        assert [c.finish_reason for c in mine] == [None] * 8 + ["length"]
    folded = deltas[0]
    for d in deltas[1:]:
        folded.add(d)
    folded.request_id = final.request_id  # generate() numbers its own requests
    assert folded == final


def test_stop_string_text_is_held_back_until_final(llm):
    """A delta never carries text that a stop string later cuts: the concatenation of what was sent
    is, at every step, a prefix of the final text."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 :][:4]
    assert len(stop.strip()) >= 2, full
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop, "zz"])
    deltas = run_steps(llm, "Once upon a time", params)
    final = full[: full.index(stop)]
    sent = ""
    for d in deltas:
        sent += "".join(c.text for c in d.outputs)
        assert final.startswith(sent)
    assert sent == final and deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == stop


def test_request_output_add():
    def lp(x: float) -> dict[int, Logprob]:
        return {1: Logprob(x, 1)}

    a = RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [1], -1.0, [lp(-1.0)])])
    a.add(RequestOutput("r", "p", [1], [CompletionOutput(1, "x", [9], None, None)]))
    a.add(RequestOutput("r", "p", [1], [CompletionOutput(0, "b", [2], -3.0, [lp(-2.0)], "stop", "b")], True))
    assert a.finished and [c.index for c in a.outputs] == [0, 1]
    c0 = a.outputs[0]
    assert (c0.text, c0.token_ids, c0.cumulative_logprob, c0.finish_reason, c0.stop_reason) == (
        "ab",
        [1, 2],
        -3.0,
        "stop",
        "b",
    )
    assert [e[1].logprob for e in c0.logprobs] == [-1.0, -2.0]


@pytest.mark.parametrize("clean_up", ["off", "on", "forced"])
def test_text_decoder_equals_the_tokenizers_decode(clean_up):
    """The detokenizer's decode (the tokenizers backend called directly, with transformers' clean-up where that
    applies) equals tokenizer.decode(ids, skip_special_tokens=True) on random ids, special tokens and the
    clean-up's patterns included, without calling transformers' decode. "forced": transformers applies its
    clean-up to this BPE tokenizer too (newer versions skip it for BPE unless told)."""
    import random

    from transformers import AutoTokenizer

    from sparseserve.engine.detokenizer import text_decoder
    from sparseserve.models.loader import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tok.clean_up_tokenization_spaces = clean_up != "off"
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = clean_up == "forced"
    decode = text_decoder(tok)
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    punct = tok.encode(" . ? ! , ' n't 'm 's 've 're", add_special_tokens=False)
    cases = []
    for n in (1, 2, 7, 40, 40, 40):
        ids = [
            rng.choice(special)
            if rng.random() < 0.2
            else rng.choice(punct)
            if rng.random() < 0.3
            else rng.randrange(len(tok))
            for _ in range(n)
        ]
        cases.append((ids, tok.decode(ids, skip_special_tokens=True)))
    if clean_up == "forced":  # the clean-up changes some of these texts
        assert any(text != tok.backend_tokenizer.decode(ids, skip_special_tokens=True) for ids, text in cases)
    tok.decode = None  # the decoder calls the backend only
    for ids, text in cases:
        assert decode(ids) == text


def _sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer built in place: Metaspace pieces, byte fallback (characters spread over byte
    tokens), the decoder's strip of the first leading space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = (
        ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + ["▁", "▁the", "▁a", "ing", "▁cat", "s", ".", ",", "▁日本", "語", "é", "▁über", "!", "▁▁", "x"]
    )
    tok = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True
        )
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


def _tokenizers():
    from sparseserve.models.gguf import find_smollm2
    from sparseserve.models.loader import DEFAULT_MODEL_DIR, load_tokenizer, resolve_model_dir

    yield "embedded", load_tokenizer(DEFAULT_MODEL_DIR)
    yield "sentencepiece-style", _sentencepiece_style_tokenizer()
    try:
        path = find_smollm2()
    except (FileNotFoundError, ImportError, OSError):
        return  # (the README's test install has it)
    yield "smollm2-gguf", load_tokenizer(resolve_model_dir(str(path)))


def test_stream_detokenizer_equals_the_two_decodes_step_by_step():
    """The Detokenizer's stream (the tokenizers backend's DecodeStream) gives, at every step, the text the two
    decodes of detokenize_incrementally give: random outputs after prompts ending in text, in multi-byte
    characters and in special tokens, byte tokens that complete characters or never do, special tokens."""
    import random

    from sparseserve.engine.detokenizer import Detokenizer, detokenize_incrementally
    from sparseserve.engine.request import Sequence

    names = []
    for name, tok in _tokenizers():
        names.append(name)
        det = Detokenizer(tok)
        assert det.streams, name  # the stream path is what this test compares
        rng = random.Random(name)
        vocab = len(tok)
        utf8 = tok.encode("é日本語ü", add_special_tokens=False)
        streamed = fell_back = 0
        for trial in range(60):
            prompt = tok.encode(
                rng.choice(["Hello there, how", "The cats.", "é ü 日本語", "x"]), add_special_tokens=rng.random() < 0.5
            )
            a = Sequence(0, "r", 0, list(prompt), SamplingParams(max_tokens=99))
            b = Sequence(1, "r", 0, list(prompt), SamplingParams(max_tokens=99))
            for _ in range(30):
                r = rng.random()
                t = rng.choice(utf8) if r < 0.3 else rng.randrange(min(vocab, 300)) if r < 0.6 else rng.randrange(vocab)
                a.token_ids.append(t)
                b.token_ids.append(t)
                new = det(b)
                assert new == detokenize_incrementally(det.decode, a), (name, trial, a.token_ids[len(prompt) :])
            streamed += b.detok_state is not False
            fell_back += b.detok_state is False
        # many sequences kept the stream to the end (random byte tokens make the others fall back)
        assert streamed >= 15, (name, streamed, fell_back)
    assert names[:2] == ["embedded", "sentencepiece-style"]
