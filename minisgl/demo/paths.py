"""Paths of the files that ship inside the minisgl package."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CHECKPOINT_DIR", "demo_model_path"]

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"

_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def demo_model_path(path: Path = CHECKPOINT_DIR) -> Path:
    """Directory of the trained demo model (a Hugging Face checkpoint), checked.

    It is the default model of ``make demo``, ``trace`` and the lessons; both
    ``transformers`` and minisgl load it.  Raises ``FileNotFoundError`` with
    the command that rebuilds it when it is missing from `path`.
    """
    missing = [name for name in _REQUIRED if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model is missing from {path} (no {', '.join(missing)}); "
            "build it with `python -m minisgl train-demo` "
            "(or `python -m minisgl.demo.train_demo`), a few minutes on CPU"
        )
    return path
