"""Checkpoint loading: a missing, malformed or contradictory checkpoint is one ValueError from
the API (and one line, exit 2, from the CLI) that names what is wrong, never a model that
loads and answers wrongly."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM

from .conftest import assert_one_line_exit_2, copy_model, no_thread_left_behind


def edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_malformed_model_dir(tmp_path, qwen3):
    with pytest.raises(ValueError):
        LLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(qwen3, broken)
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(ValueError):
        LLM(broken)


def test_unsupported_architecture(tmp_path, qwen3):
    other = tmp_path / "gpt2ish"
    shutil.copytree(qwen3, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(other)


def test_model_type_contradicting_architecture_refused(qwen3, tmp_path):
    folder = copy_model(qwen3, tmp_path / "m")
    edit_config(folder, model_type="llama")  # Qwen3ForCausalLM weights, llama type: q/k norms left out
    with pytest.raises(ValueError, match="contradicts"):
        LLM(folder)


def test_unused_checkpoint_tensor_refused_by_name(qwen3, tmp_path):
    folder = copy_model(qwen3, tmp_path / "m")
    edit_tensors(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match="extra_proj"):
        LLM(folder)


# Bad checkpoints: one ValueError from the API, one line and exit 2 from the CLI ---------------
def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _corrupt_header(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:40] = b"#" * 32
    (folder / "model.safetensors").write_bytes(bytes(data))


def _shard_index_without_weight_map(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def _unreadable_weights(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()  # exists, cannot be read as a file (even by root)


def _wrong_shape(folder):
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.ones(3)}))


def _stale_second_copy(folder):
    """A stale shard next to model.safetensors: which copy loads would depend on file order."""
    norm = load_file(folder / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": norm * 0}, folder / "stale.safetensors")
    (folder / "model.safetensors").rename(folder / "fresh.safetensors")


def _rope_theta(value):
    # A transformers 4.x config: rope_theta at the top level, no rope_parameters.
    return lambda f: edit_config(f, rope_parameters=None, rope_theta=value)


def _replaced_by(make, name):
    """The checkpoint's file `name` replaced by what make(path) creates (a FIFO, a link)."""
    def replace(folder):
        (folder / name).unlink(missing_ok=True)
        make(folder / name)
    return replace


def _edit_generation_config(folder, **changes):
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _linear_rope(factor):
    return lambda f: edit_config(f, rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": 10000.0})


# case -> (how to break the copied checkpoint, what the one error message must name)
BREAKERS = {
    "truncated": (_truncate, "model.safetensors"),
    "empty": (lambda f: (f / "model.safetensors").write_bytes(b""), "model.safetensors"),
    "corrupt header": (_corrupt_header, "model.safetensors"),
    "wrong shape": (_wrong_shape, "model.norm.weight"),
    "no vocab_size": (lambda f: edit_config(f, vocab_size=None), "vocab_size"),
    "no hidden_size": (lambda f: edit_config(f, hidden_size=None), "hidden_size"),
    "no head_dim": (lambda f: edit_config(f, head_dim=None), "config implies"),  # Qwen3's default is 128
    "string hidden_size": (lambda f: edit_config(f, hidden_size="64"), "hidden_size"),
    "float vocab_size": (lambda f: edit_config(f, vocab_size=300.5), "vocab_size"),
    "index without weight_map": (_shard_index_without_weight_map, "weight_map"),
    "list generation_config": (lambda f: (f / "generation_config.json").write_text("[1, 2]"), "generation_config"),
    # Eos ids that are no token of the model were accepted (a request could never stop on them):
    "eos -5 in generation_config": (lambda f: _edit_generation_config(f, eos_token_id=-5), "eos_token_id -5"),
    "eos 10**30 in generation_config": (lambda f: _edit_generation_config(f, eos_token_id=10 ** 30), "eos_token_id"),
    "eos list with a string": (lambda f: _edit_generation_config(f, eos_token_id=[1, "2"]), "eos_token_id"),
    "eos true in generation_config": (lambda f: _edit_generation_config(f, eos_token_id=True), "eos_token_id"),
    "eos vocab_size in config.json": (lambda f: edit_config(f, eos_token_id=100_000), "config.json': eos_token_id 100000"),
    "negative max_position_embeddings": (lambda f: edit_config(f, max_position_embeddings=-5),
                                         "max_position_embeddings"),
    "unreadable weights": (_unreadable_weights, "model.safetensors"),
    # Each of these loaded, and answered token 0 forever (nan) or another model's tokens:
    "nan weight": (lambda f: edit_tensors(f, lambda t: t["model.norm.weight"].fill_(float("nan"))), "nan or inf"),
    "integer weight": (lambda f: edit_tensors(f, lambda t: t.update(
        {"model.norm.weight": t["model.norm.weight"].to(torch.int64)})), "floating-point types"),
    "tensor in two files": (_stale_second_copy, "stored twice"),
    "rope_theta 0": (_rope_theta(0), "rope_theta"),
    "rope_theta -1": (_rope_theta(-1), "rope_theta"),
    "rope_theta string": (_rope_theta("big"), "rope_theta"),  # was a TypeError from inside torch
    "linear rope factor 0": (_linear_rope(0), "factor"),
    # Positive and finite, yet meaningless (issue 26, finding 10): the speeds were inf (every token 0)...
    "rope_theta 1e-45": (_rope_theta(1e-45), "rope_theta"),
    "linear rope factor 1e-40": (_linear_rope(1e-40), "factor"),
    # ... or all equal, or too slow to tell neighbouring positions apart, or positions not exact in float32.
    "rope_theta 1": (_rope_theta(1), "rope_theta"),
    "linear rope factor 1e40": (_linear_rope(1e40), "factor"),
    "rope_type a list": (lambda f: edit_config(f, rope_parameters={"rope_type": ["linear"], "rope_theta": 1e4}),
                         "rope_type"),
    "max_position_embeddings 2**25": (lambda f: edit_config(f, max_position_embeddings=2 ** 25),
                                      "max_position_embeddings"),
    # Sizes beyond the weights (finding 13): 10**5 layers took 92 s to fail (a model built first), the
    # others were a RuntimeError or TypeError from inside torch. Each is now refused from the headers.
    "num_hidden_layers 10**5": (lambda f: edit_config(f, num_hidden_layers=10 ** 5, layer_types=None),
                                "num_hidden_layers"),
    "vocab_size 2**40": (lambda f: edit_config(f, vocab_size=2 ** 40), "vocab_size"),
    "head_dim 2**40": (lambda f: edit_config(f, head_dim=2 ** 40), "head_dim"),
    "intermediate_size 2**40": (lambda f: edit_config(f, intermediate_size=2 ** 40), "intermediate_size"),
    "float8 weight": (lambda f: edit_tensors(f, lambda t: t.update(
        {"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn)})), "float8"),
    # Metadata files that are not regular files: a FIFO hung the reader, /dev/zero read until MemoryError.
    "generation_config FIFO": (_replaced_by(os.mkfifo, "generation_config.json"), "generation_config"),
    "generation_config -> /dev/zero": (_replaced_by(lambda p: os.symlink("/dev/zero", p), "generation_config.json"),
                                       "generation_config"),
    "tokenizer.json FIFO": (_replaced_by(os.mkfifo, "tokenizer.json"), "tokenizer.json"),
    "weights FIFO": (_replaced_by(os.mkfifo, "model.safetensors"), "model.safetensors"),
    # JSON nested past the parser's stack raised RecursionError with a traceback
    "config nested 200,000 deep": (lambda f: (f / "config.json").write_text("[" * 200_000 + "]" * 200_000),
                                   "config.json"),
}


@pytest.mark.parametrize("case", list(BREAKERS))
def test_malformed_checkpoint_one_error(qwen3, tmp_path, capsys, case):
    folder = copy_model(qwen3, tmp_path / "m")
    breaker, names = BREAKERS[case]
    breaker(folder)
    with no_thread_left_behind():
        with pytest.raises(ValueError, match=names):
            LLM(folder)
    assert_one_line_exit_2(capsys, "generate", "--model", str(folder), "--prompt", "hi")
