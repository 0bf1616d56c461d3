"""Reading a Hugging Face checkpoint folder, with one clear ValueError for each way it can be broken.

A malformed checkpoint must never load as a *different* model (a missing key silently
replaced by a transformers default, a Qwen3 loaded without its q/k norms because
`model_type` says llama) nor fail later with a traceback from deep inside torch. So the
raw config.json is checked before transformers fills in defaults, the architecture comes
from `architectures` (the class the weights were trained for), and every weights file is
opened and read under a guard that names the file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from ..checks import is_int
from .rope import check_rope, rope_parameters

# The architecture names we implement, and the `model_type` each one must carry.
FAMILY_OF_ARCHITECTURE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(FAMILY_OF_ARCHITECTURE)

# Sizes the model is built from: required, because a transformers default (e.g. Qwen3's
# 151936-token vocabulary) would build a model that does not match the weights.
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")


# The files besides the weights that minisgl or transformers read from a checkpoint folder. Each
# must be a regular file of at most MAX_METADATA_BYTES: a FIFO blocks its reader forever, and a
# link to /dev/zero is read until MemoryError. The limit sits well above any published tokenizer.json.
METADATA_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "tokenizer.model", "chat_template.jinja", "chat_template.json")
MAX_METADATA_BYTES = 256 << 20

# Floating-point weights we read; float8 and others need scales this loader does not apply.
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_regular_file(path: Path, max_bytes: int | None) -> None:
    """`path` (symlinks followed) is a regular file of at most `max_bytes`; stat() never blocks."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{str(path)!r} is not a regular file (a directory, FIFO or device); it cannot be read")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{str(path)!r} is {info.st_size} bytes, more than the {max_bytes >> 20} MiB a "
                         f"checkpoint's metadata file may hold")


def check_metadata_files(model_dir: Path) -> None:
    for name in METADATA_FILES:
        if os.path.lexists(model_dir / name):
            check_regular_file(model_dir / name, MAX_METADATA_BYTES)


def read_json_object(path: Path) -> dict[str, Any]:
    check_regular_file(path, MAX_METADATA_BYTES)
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_METADATA_BYTES + 1).decode()  # bounded: the file may have grown since stat()
        if len(text) > MAX_METADATA_BYTES:
            raise ValueError(f"{str(path)!r} holds more than {MAX_METADATA_BYTES >> 20} MiB")
        value = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from exc
    except RecursionError:  # nesting deeper than the parser's stack: no config is shaped like that
        raise ValueError(f"cannot read {str(path)!r}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, not a {type(value).__name__}")
    return value


def load_config(model_dir: Path, dtype: torch.dtype) -> tuple[PretrainedConfig, str]:
    """The checked config of `model_dir` (for a model in `dtype`) and its family ("llama", "qwen2" or "qwen3")."""
    if not model_dir.is_dir():
        reason = "is not a directory" if model_dir.exists() else "does not exist"
        raise ValueError(f"model directory {str(model_dir)!r} {reason}")
    check_metadata_files(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(model_dir)!r} has no config.json; expected a Hugging Face checkpoint folder")
    raw = read_json_object(path)
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ValueError(f"{str(path)!r}: 'architectures' must be a list naming one of {SUPPORTED_ARCHITECTURES}")
    arch = archs[0]
    if arch not in FAMILY_OF_ARCHITECTURE:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = FAMILY_OF_ARCHITECTURE[arch]
    if raw.get("model_type") != family:
        raise ValueError(f"{str(path)!r}: model_type {raw.get('model_type')!r} contradicts architecture {arch} "
                         f"(which needs model_type {family!r})")
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        if key in REQUIRED_SIZES and key not in raw:
            raise ValueError(f"{str(path)!r} has no {key!r}")
        value = raw.get(key)
        if value is not None and not (is_int(value) and value > 0):
            raise ValueError(f"{str(path)!r}: {key} must be a positive integer, got {value!r}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"{str(path)!r}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if raw.get("head_dim") is None and raw["hidden_size"] % heads:
        raise ValueError(f"{str(path)!r}: hidden_size {raw['hidden_size']} is not a multiple of "
                         f"num_attention_heads {heads}, and there is no head_dim")
    if head_dim % 2:
        raise ValueError(f"{str(path)!r}: head_dim {head_dim} must be even (rotary embeddings rotate pairs)")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"{str(path)!r}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    if not isinstance(raw.get("tie_word_embeddings", False), bool):
        raise ValueError(f"{str(path)!r}: tie_word_embeddings must be true or false")
    check_sizes_against_weights(raw, head_dim, model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers' own checks raise many types
        raise ValueError(f"cannot load {str(path)!r}: {exc}") from exc
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not implemented")
    check_rope(rope_parameters(config), head_dim, int(config.max_position_embeddings), dtype, path)
    return config, family


def check_sizes_against_weights(raw: dict, head_dim: int, model_dir: Path) -> None:
    """config.json's sizes against the shapes in the weights files' headers (no tensor is read),
    before anything is built from them: a size larger than the weights (10**5 layers, a vocabulary
    of 10**12) would otherwise build a huge model first, or fail deep inside torch."""
    with ExitStack() as stack:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name, (handle, _) in
                  open_all(safetensors_files(model_dir), torch.device("cpu"), stack).items()}
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    kv_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]

    def stored(name: str, dim: int) -> int | None:
        shape = shapes.get(name)
        return shape[dim] if shape is not None and len(shape) > dim else None  # a missing one is named later

    checks = [  # (the config's field(s), their value, what the weights hold, where)
        ("vocab_size", raw["vocab_size"], stored("model.embed_tokens.weight", 0), "rows of model.embed_tokens.weight"),
        ("hidden_size", raw["hidden_size"], stored("model.embed_tokens.weight", 1),
         "columns of model.embed_tokens.weight"),
        ("num_hidden_layers", raw["num_hidden_layers"], len(layers) if layers else None, "model.layers.N in the weights"),
        ("intermediate_size", raw["intermediate_size"], stored("model.layers.0.mlp.gate_proj.weight", 0),
         "rows of model.layers.0.mlp.gate_proj.weight"),
        ("num_attention_heads x head_dim", raw["num_attention_heads"] * head_dim,
         stored("model.layers.0.self_attn.q_proj.weight", 0), "rows of model.layers.0.self_attn.q_proj.weight"),
        ("num_key_value_heads x head_dim", kv_heads * head_dim, stored("model.layers.0.self_attn.k_proj.weight", 0),
         "rows of model.layers.0.self_attn.k_proj.weight"),
    ]
    for field, value, held, where in checks:
        if held is not None and value != held:
            raise ValueError(f"{str(model_dir / 'config.json')!r}: {field} is {value}, the weights hold {held} "
                             f"({where})")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weights files: those a sharded index names, else model.safetensors, else any *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index maps every tensor name to its shard file
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{str(index)!r} has no 'weight_map' from tensor names to shard files")
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))  # some other naming, e.g. a lone shard set
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(model_dir)!r} (other formats are not supported)")
    return files


def open_safetensors(path: Path, device: torch.device):
    """safe_open, with a missing, unreadable or corrupt file reported as a ValueError naming it."""
    check_regular_file(path, None)
    try:
        with open(path, "rb"):  # the OS's reason (no permission...), not safetensors' guess
            pass
        return safe_open(str(path), framework="pt", device=str(device))
    except OSError as exc:
        raise ValueError(f"cannot read weights file {str(path)!r}: {exc.strerror or exc}") from exc
    except SafetensorError as exc:
        raise ValueError(f"{str(path)!r} is not a valid safetensors file: {exc}") from exc


def open_all(files: list[Path], device: torch.device, stack: ExitStack) -> dict[str, tuple[Any, Path]]:
    """Tensor name -> (open handle, file) over every weights file. A name stored in two files
    is an error: which copy would win depends on the file order, e.g. a stale shard left next
    to a fresh model.safetensors."""
    file_of: dict[str, tuple[Any, Path]] = {}
    for path in files:
        handle = stack.enter_context(open_safetensors(path, device))
        for name in handle.keys():
            if name in file_of:
                raise ValueError(f"tensor {name!r} is stored twice, in {str(file_of[name][1])!r} and {str(path)!r}")
            file_of[name] = (handle, path)
    return file_of


def read_tensor(handle, name: str, path: Path) -> torch.Tensor:
    """One tensor, which must hold finite floating-point numbers: a nan or inf weight (a corrupt
    or badly converted file) would load, and the model would answer wrongly, silently."""
    try:
        tensor = handle.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from exc
    if tensor.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"tensor {name!r} in {str(path)!r} is {tensor.dtype}, not one of the floating-point types "
                         f"read here: {', '.join(str(d) for d in WEIGHT_DTYPES)} (float8 needs scales not applied here)")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"tensor {name!r} in {str(path)!r} holds nan or inf values")
    return tensor
