"""Model directories in Hugging Face format: config, dtype, safetensors weights (one file or
sharded). GGUF files resolve to a directory converted from them (models/gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from sparseserve.attention.backend import AttentionBackend
from sparseserve.models.config import ArchConfig
from sparseserve.models.gguf import KNOWN_MODELS, gguf_model_dir, is_gguf_path
from sparseserve.models.llama import LlamaForCausalLM

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_model_dir(model: str | None) -> Path:
    """A Hugging Face model directory for `model`: a directory, a .gguf file (converted once,
    cached), a known model name (`smollm2`) when no such path exists, or None (embedded model)."""
    path = DEFAULT_MODEL_DIR if model is None else Path(model).expanduser()
    if model is not None and not path.exists() and model in KNOWN_MODELS:
        path = KNOWN_MODELS[model]()
    if is_gguf_path(path):
        return gguf_model_dir(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory not found: {path} (expected a Hugging Face model directory or a .gguf file)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    return path


# A Llama config.json that spells out every key whose default ArchConfig.from_hf would take from
# LlamaConfig is read as plain JSON, skipping transformers' slow config imports. Any other config
# goes through AutoConfig (its defaults and rope checks).
_PLAIN_LLAMA_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "eos_token_id",
)


def load_hf_config(path: Path):
    """The model's config: a namespace over config.json for a fully spelled-out Llama config
    (see above), else transformers' AutoConfig."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"unsupported or invalid model config in {path}: {e}") from e
    if (
        isinstance(raw, dict)
        and raw.get("model_type") == "llama"
        and all(k in raw for k in _PLAIN_LLAMA_KEYS)
        and "rope_scaling" not in raw
        and ("rope_parameters" in raw or "rope_theta" in raw)
    ):
        return SimpleNamespace(**raw)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError) as e:  # unknown model_type and similar
        raise ValueError(f"unsupported or invalid model config in {path}: {e}") from e


# Tokenizer classes AutoTokenizer resolves to the `tokenizers`-backed base class: loaded as that
# class directly, skipping AutoTokenizer's AutoConfig lookup (the same slow imports).
_PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a model or tokenizer directory (AutoTokenizer's, see above)."""
    path = Path(path)
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        cls = None
    if cls in _PLAIN_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def resolve_dtype(dtype: str, hf_config, device: torch.device | None = None) -> torch.dtype:
    """auto: the checkpoint's dtype on a GPU; float32 on the CPU (no half-precision units, so
    half-precision math is slower there)."""
    if dtype == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        found = _DTYPES.get(found, None) if isinstance(found, str) else found
        if found not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported checkpoint dtype {found}; pass dtype= float32, bfloat16 or float16")
        return torch.float32 if device is not None and device.type == "cpu" else found
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def build_model(
    cfg: ArchConfig,
    backend: AttentionBackend,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
) -> LlamaForCausalLM:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, backend)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        with torch.no_grad():  # small random weights, unit norms: runs, answers nothing
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    else:
        load_weights(model, path)
    return model.eval().requires_grad_(False)


class _LazySlice:
    """A checkpoint tensor not read yet: `.shape`, and `.narrow` reads only the asked part (a
    tensor-parallel rank reads its shard, not the whole checkpoint)."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]


def _default_loader(param: torch.Tensor, loaded, shard_id: int | None = None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded.narrow(0, 0, loaded.shape[0]))


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Each parameter's `weight_loader` (layers/linear.py) copies this rank's part of its
    checkpoint tensor; parameters without one are whole on every rank (norms)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue  # recomputed from the config
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                target, shard = name, None
                for proj, (packed, idx) in model.packed_modules.items():
                    if f".{proj}." in name:
                        target, shard = name.replace(f".{proj}.", f".{packed}."), idx
                        break
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                param = params[target]
                try:
                    getattr(param, "weight_loader", _default_loader)(param, _LazySlice(f, name), shard)
                except ValueError as e:
                    raise ValueError(f"weight {name!r} {e}") from e
                loaded.add(target if shard is None else f"{target}#{shard}")
    expected = set()
    for pname, param in params.items():
        shards = getattr(param, "num_shards", None)
        expected.update([pname] if shards is None else [f"{pname}#{i}" for i in range(shards)])
    if model.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint in {path} is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
