"""A tiny synthetic task family that the demo model learns to answer exactly.

Each example is a ``(prompt, answer)`` pair of plain strings:

=========  ==========================  =============================
task       prompt                      answer
=========  ==========================  =============================
count      ``count 3 to 9:``           `` 3 4 5 6 7 8 9``
reverse    ``reverse cat dog owl:``    `` owl dog cat``
add        ``add 17 25:``              `` 42``
repeat     ``repeat fox 4:``           `` fox fox fox fox``
=========  ==========================  =============================

Answers range from two tokens (`` 7``) to about thirty (a long count), so a
batch of demo requests finishes at clearly different steps -- which is what a
learner wants to watch in the overlap scheduler.

Prompts always end with ``":"`` and answers always start with a space.  With
the demo tokenizer that makes the boundary clean: the ids of
``prompt + answer`` are the ids of ``prompt`` followed by the ids of
``answer``.  The model is trained to emit EOS right after the answer.

Held-out split: a prompt is *held out* when a hash of its text falls in a
fixed 1-in-10 bucket.  :func:`sample_example` with ``split="train"`` never
returns a held-out prompt, and :func:`demo_prompts` only returns held-out
ones, so the accuracy the demo reports is measured on prompts the model has
never seen.
"""

from __future__ import annotations

import hashlib
import random
from typing import Iterator

__all__ = [
    "TASKS",
    "TASK_WEIGHTS",
    "WORDS",
    "make_example",
    "is_held_out",
    "sample_example",
    "iter_examples",
    "demo_prompts",
    "tokenizer_corpus",
]

TASKS = ("count", "reverse", "add", "repeat")

# Short, distinct words; each becomes one token (with its leading space).
WORDS = (
    "cat", "dog", "owl", "fox", "bee", "cow", "pig", "ant",
    "red", "blue", "green", "gold", "pink", "gray",
    "sun", "moon", "star", "rain", "snow", "wind",
    "tree", "leaf", "rock", "sand", "lake", "hill",
    "cup", "box", "key", "pen", "hat", "bell",
)

COUNT_MAX = 99  # numbers in "count" stay in 0..99
COUNT_LEN = (1, 10)  # how many numbers a count answer has
ADD_MAX = 99  # operands of "add" are in 0..99
REVERSE_LEN = (2, 6)  # words in a "reverse" prompt
REPEAT_LEN = (1, 9)  # times a word is repeated

HELD_OUT_BUCKETS = 10  # one prompt in ten is held out


def _count(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(*COUNT_LEN)
    a = rng.randint(0, COUNT_MAX - n + 1)
    b = a + n - 1
    return f"count {a} to {b}:", "".join(f" {i}" for i in range(a, b + 1))


def _reverse(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(*REVERSE_LEN)
    words = [rng.choice(WORDS) for _ in range(k)]
    return "reverse " + " ".join(words) + ":", "".join(f" {w}" for w in reversed(words))


def _add(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, ADD_MAX)
    b = rng.randint(0, ADD_MAX)
    return f"add {a} {b}:", f" {a + b}"


def _repeat(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(WORDS)
    n = rng.randint(*REPEAT_LEN)
    return f"repeat {w} {n}:", f" {w}" * n


_MAKERS = {"count": _count, "reverse": _reverse, "add": _add, "repeat": _repeat}


# How often each task is drawn when none is asked for.  Addition (carries,
# operands of different lengths) is the hardest to learn, repeating the easiest.
TASK_WEIGHTS = {"count": 0.3, "reverse": 0.2, "add": 0.35, "repeat": 0.15}


def make_example(rng: random.Random, task: str | None = None) -> tuple[str, str]:
    """One ``(prompt, answer)`` pair of ``task`` (a weighted random task if None), from either split."""
    if task is None:
        task = rng.choices(TASKS, weights=[TASK_WEIGHTS[t] for t in TASKS])[0]
    try:
        maker = _MAKERS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}") from None
    return maker(rng)


def is_held_out(prompt: str) -> bool:
    """True if ``prompt`` belongs to the held-out split (never trained on)."""
    h = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little") % HELD_OUT_BUCKETS == 0


def sample_example(
    rng: random.Random, split: str = "train", task: str | None = None
) -> tuple[str, str]:
    """Draw an example of ``split`` ("train" or "held_out") by rejection sampling."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', not {split!r}")
    want_held_out = split == "held_out"
    while True:
        prompt, answer = make_example(rng, task)
        if is_held_out(prompt) == want_held_out:
            return prompt, answer


def iter_examples(seed: int, split: str = "train") -> Iterator[tuple[str, str]]:
    """An endless, seeded stream of examples of one split."""
    rng = random.Random(seed)
    while True:
        yield sample_example(rng, split)


def demo_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct held-out ``(prompt, expected_answer)`` pairs.

    The tasks are mixed evenly (a task whose held-out pool is used up is
    skipped).  ``expected_answer`` is exactly the text a correct model
    generates before EOS (EOS itself is not included).  The same ``(n, seed)``
    always gives the same list; a smaller ``n`` gives a prefix of a larger one.
    """
    rng = random.Random(f"minisgl-demo-prompts-{seed}")
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        task = TASKS[len(out) % len(TASKS)] if misses < 50 else None
        prompt, answer = sample_example(rng, "held_out", task)
        if prompt in seen:
            misses += 1
            if misses > 10_000:
                raise ValueError(f"cannot draw {n} distinct held-out prompts")
            continue
        misses = 0
        seen.add(prompt)
        out.append((prompt, answer))
    return out


def tokenizer_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Texts for training the demo tokenizer: every word and prompt shape, many times."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        prompt, answer = make_example(rng)
        texts.append(prompt + answer)
    # make sure each word appears often enough to be merged into one token
    texts.extend(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS)))
    return texts
