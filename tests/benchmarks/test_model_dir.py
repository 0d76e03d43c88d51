"""benchmarks/model_dir.py: each preset's shapes as the engine reads them, the embedded tokenizer's vocabulary on
request, and random weights that transformers and the engine both load."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import model_dir as M
from sparseserve.models.config import ArchConfig
from sparseserve.models.loader import DEFAULT_MODEL_DIR, load_hf_config

SHAPES = {  # layers, query heads, KV heads, hidden, intermediate, positions
    "llama-3.1-8b": (32, 32, 8, 4096, 14336, 131072),
    "mha7b": (32, 32, 32, 4096, 11008, 65536),
    "gqa8b": (32, 32, 8, 4096, 14336, 262144),
    "smollm2-135m": (30, 9, 3, 576, 1536, 8192),
    "llama-3.1-70b": (80, 64, 8, 8192, 28672, 131072),
}


@pytest.mark.parametrize("preset", list(M.PRESETS))
def test_presets_have_their_architectures_shapes(tmp_path, preset):
    out = M.make_model_dir(tmp_path / preset, preset)
    a = ArchConfig.from_hf(load_hf_config(out))
    assert (
        a.num_layers,
        a.num_heads,
        a.num_kv_heads,
        a.hidden_size,
        a.intermediate_size,
        a.max_position_embeddings,
    ) == SHAPES[preset]
    assert a.head_dim == a.hidden_size // a.num_heads and a.vocab_size == M.PRESETS[preset]["vocab_size"]
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))


def test_embedded_vocab_takes_the_tokenizers_ids():
    embedded = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    cfg = M.model_config("mha7b", embedded_vocab=True)
    assert [cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")] == [
        embedded[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")
    ]
    assert cfg["num_key_value_heads"] == 32 and cfg["intermediate_size"] == 11008


def test_the_8b_dir_of_the_experiments(tmp_path):
    from benchmarks.common import make_8b_dir

    cfg = json.loads((make_8b_dir(tmp_path / "m") / "config.json").read_text())
    assert cfg["vocab_size"] == 4096 and cfg["head_dim"] == 128 and cfg["num_key_value_heads"] == 8
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and (tmp_path / "m" / "generation_config.json").is_file()


def test_random_weights_load_in_transformers_and_the_engine(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from sparseserve import LLM, SamplingParams

    tiny = dict(
        M.PRESETS["llama-3.1-8b"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=9,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=512,
    )
    monkeypatch.setitem(M.PRESETS, "tiny", tiny)
    M.main(["--preset", "tiny", "--out", str(tmp_path / "m")])
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # shards of 8 layers
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert hf.model.layers[8].mlp.down_proj.weight.shape == (64, 128)
    out = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", max_model_len=64).generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False
    )
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=3, do_sample=False)[0, 3:].tolist()
    assert list(out[0].outputs[0].token_ids) == ref
    with pytest.raises(SystemExit, match="exists"):
        M.main(["--preset", "tiny", "--out", str(tmp_path / "m")])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_70b_shape_splits_for_tensor_parallelism(tmp_path, tp):
    """The preset gpu_tp_check.sh serves at TP=4 (and 2): its heads and MLP split, its bf16 weights need more
    than one 80-GB GPU, and it keeps Llama-3.1's rope and positions."""
    from sparseserve.config import EngineConfig
    from sparseserve.engine.parallel import check_model

    out = M.make_model_dir(tmp_path / "70b", "llama-3.1-70b", embedded_vocab=True)
    check_model(EngineConfig.from_kwargs(tensor_parallel_size=tp), out)
    a = ArchConfig.from_hf(load_hf_config(out))
    layer = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads) + 3 * a.hidden_size * 28672
    assert 130e9 < 2 * a.num_layers * layer < 145e9  # bf16 bytes, the embedded vocabulary's tables aside
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_parameters"] == M.PRESETS["llama-3.1-8b"]["rope_parameters"]
    assert cfg["vocab_size"] == 4096  # the embedded tokenizer's, for a server that decodes every id
