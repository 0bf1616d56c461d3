"""minisgl: a teaching-oriented, minimal but real LLM inference engine.

It exists to make SGLang's overlap scheduler understandable: read `minisgl/scheduler.py`
(normal_loop and overlap_loop side by side), run the lessons, switch mechanisms off."""

from importlib import import_module

__all__ = ["LLM", "SamplingParams", "RequestOutput", "MECHANISMS", "demo_model_path", "demo_prompts"]

# Imported on first use: `python -m minisgl` runs this file before the command line can catch a
# Ctrl-C, and importing torch and transformers takes seconds (a Ctrl-C then was a traceback).
_LAZY = {"LLM": ".frontend.llm", "SamplingParams": ".sampling_params", "RequestOutput": ".sampling_params", "MECHANISMS": ".mechanisms"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)


def demo_model_path():
    """Directory of the demo model shipped in the package (see minisgl/demo/checkpoint/TRAINING.md)."""
    from .demo.paths import demo_model_path as path

    return path()


def demo_prompts(n: int, seed: int = 0):
    """`n` held-out (prompt, expected_answer) pairs from the demo model's task generator."""
    from .demo.tasks import demo_prompts as prompts

    return prompts(n, seed)
