"""minisgl: a teaching-oriented, minimal but real LLM inference engine.

It exists to make SGLang's overlap scheduler understandable: read `minisgl/scheduler.py`
(normal_loop and overlap_loop side by side), run the lessons, switch mechanisms off.
"""

from .llm import LLM
from .mechanisms import MECHANISMS
from .request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "MECHANISMS", "demo_model_path", "demo_prompts"]


def demo_model_path():
    """Directory of the demo model shipped in the package (see minisgl/demo/checkpoint/TRAINING.md)."""
    from .demo.paths import demo_model_path as path

    return path()


def demo_prompts(n: int, seed: int = 0):
    """`n` held-out (prompt, expected_answer) pairs from the demo model's task generator."""
    from .demo.tasks import demo_prompts as prompts

    return prompts(n, seed)
