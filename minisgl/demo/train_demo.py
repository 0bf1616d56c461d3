"""Train the small demo model that ships in ``minisgl/demo/checkpoint/``.

Random weights babble and almost never emit EOS, so with them nobody can see
at a glance whether the scheduler stopped a request at the right token.  This
module trains a tiny Qwen3-style model on the synthetic tasks of
:mod:`minisgl.demo.tasks` ("count 3 to 9:" -> " 3 4 5 6 7 8 9", ...), until it
answers held-out prompts exactly and then stops with EOS.

Steps (all offline, seeded, CPU only):

1. train a byte-level BPE tokenizer on the task corpus plus a short English text;
2. build ``transformers.Qwen3ForCausalLM`` from a small config;
3. train it with AdamW on an endless stream of *training-split* examples; the
   loss covers only the answer tokens and the EOS after them (the prompt is
   context, not a target);
4. measure exact-match accuracy with ``transformers`` greedy ``generate`` on
   held-out prompts (:func:`minisgl.demo.tasks.demo_prompts`);
5. save a Hugging Face checkpoint (safetensors, float32) and ``TRAINING.md``.

Run it with ``python -m minisgl train-demo`` or ``python -m minisgl.demo.train_demo``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import tasks as demo_tasks
from .tiny import add_legacy_rope_theta, builtin_text, train_bpe_tokenizer

__all__ = ["DEFAULT_OUT", "DEFAULT_STEPS", "MODEL_CONFIG", "DRAFT_CONFIG", "train_demo", "evaluate", "main"]

DEFAULT_OUT = Path(__file__).resolve().parent / "checkpoint"
DEFAULT_STEPS = 2500
DEFAULT_SEED = 0
# Documented maxima of train-demo's flags: beyond them a run does not finish in a day on a laptop
# (steps, held-out prompts), or asks for more than a laptop holds (64 times the default batch).
MAX_STEPS = 1_000_000
MAX_BATCH_SIZE = 4096
MAX_EVAL = 100_000
MAX_THREADS = 256
VOCAB_SIZE = 512

# The demo model: a small Qwen3 (q/k RMSNorm, GQA, SwiGLU, RoPE, tied embeddings).
MODEL_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    initializer_range=0.02,
    hidden_act="silu",
)

# The demo's draft model for speculative decoding (`--draft`): the same tokenizer and tasks, a
# half the depth and half the width, trained for fewer steps. It need not be exact,
# only often right: every token it gets right is one the target accepts without a step of its own.
DRAFT_CONFIG = dict(MODEL_CONFIG, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=192)
DRAFT_STEPS = 2000

# Files a finished checkpoint directory consists of (old ones are replaced).
_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "TRAINING.md",
)


class _Encoder:
    """Tokenizes prompts and answers separately (as inference does) with a cache."""

    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(self.cache) < 200_000:
                self.cache[text] = ids
        return ids


def _batches(stream, enc: _Encoder, batch_size: int, eos_id: int, pad_id: int):
    """Endless batches of (input ids, target ids, loss mask), right padded.

    Batches are plain random draws.  (Grouping examples of similar length
    would waste less compute on padding, but the homogeneous batches it makes
    trained a noticeably less accurate model in the same time.)
    """
    while True:
        items = []
        for _ in range(batch_size):
            prompt, answer = next(stream)
            p, a = enc(prompt), enc(answer)
            items.append((p + a + [eos_id], len(p)))
        yield _collate(items, pad_id)


def _collate(items, pad_id: int):
    seqs = [s for s, _ in items]
    starts = [st for _, st in items]
    batch_size = len(items)
    width = max(len(s) for s in seqs)
    ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, width - 1), dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        # position t predicts token t+1; targets are the answer tokens and EOS
        mask[i, st - 1 : len(s) - 1] = True
    return ids[:, :-1], ids[:, 1:], mask


def _lr(step: int, steps: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, tok, pairs, max_new_tokens: int = 64) -> dict:
    """Greedy-decode each prompt alone with ``transformers`` ``generate``.

    A prompt counts as correct when the decoded new tokens equal the expected
    answer exactly and generation ended with EOS.
    """
    model.eval()
    # Decoding a model this small is dominated by per-op overhead; one thread is
    # as fast as two on an idle machine and far faster on a busy one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _evaluate(model, tok, pairs, max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def _evaluate(model, tok, pairs, max_new_tokens: int) -> dict:
    eos = tok.eos_token_id
    per_task: dict[str, list[int]] = {}
    failures = []
    correct = 0
    for prompt, expected in pairs:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
        new = out[0, ids.shape[1] :].tolist()
        stopped = bool(new) and new[-1] == eos
        text = tok.decode(new[:-1] if stopped else new)
        ok = stopped and text == expected
        correct += ok
        task = prompt.split(" ", 1)[0]
        per_task.setdefault(task, [0, 0])
        per_task[task][0] += ok
        per_task[task][1] += 1
        if not ok and len(failures) < 10:
            failures.append({"prompt": prompt, "expected": expected, "got": text, "stopped": stopped})
    n = len(pairs)
    return {
        "n": n,
        "correct": correct,
        "accuracy": correct / max(1, n),
        "per_task": {k: v[0] / v[1] for k, v in sorted(per_task.items())},
        "failures": failures,
    }


def train_demo(
    out_dir: str | Path = DEFAULT_OUT,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = DEFAULT_SEED,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup: int = 100,
    weight_decay: float = 0.01,
    eval_prompts: int = 200,
    threads: int = 2,
    log_every: int = 100,
    save: bool = True,
    log=print,
    draft: bool = False,
) -> dict:
    """Train the demo model and write it to ``out_dir``; return its statistics.

    The same arguments give the same weights (on the same torch build and
    thread count).  ``eval_prompts`` held-out prompts from
    ``demo_prompts(eval_prompts, seed=0)`` are decoded greedily at the end.
    ``draft``: the small draft model (DRAFT_CONFIG), with the same tokenizer.
    """
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    t0 = time.time()
    torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    # Build everything in a scratch directory (outside the package, so an
    # interrupted run leaves nothing behind) and move it into out_dir at the end.
    work = Path(tempfile.mkdtemp(prefix="minisgl-train-demo-"))

    # 1. tokenizer
    texts = [builtin_text()] + demo_tasks.tokenizer_corpus(seed=seed)
    tok = train_bpe_tokenizer(texts, VOCAB_SIZE, work, model_max_length=MODEL_CONFIG["max_position_embeddings"])
    eos_id, bos_id, pad_id = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id

    # 2. model
    shape = DRAFT_CONFIG if draft else MODEL_CONFIG
    config = Qwen3Config(
        vocab_size=len(tok),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        **shape,
    )
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[train-demo] Qwen3 {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"vocab {len(tok)}: {n_params:,} parameters")

    # 3. training
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    stream = demo_tasks.iter_examples(seed, "train")
    batches = _batches(stream, _Encoder(tok), batch_size, eos_id, pad_id)
    model.train()
    losses: list[float] = []
    t_train = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        inp, tgt, mask = next(batches)
        logits = model(input_ids=inp, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[mask], tgt[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            el = time.time() - t_train
            log(f"[train-demo] step {step + 1}/{steps}  loss {recent:.4f}  {el:.0f}s "
                f"({el / (step + 1):.2f}s/step)")
    train_seconds = time.time() - t_train
    load_after = os.getloadavg()[1] if hasattr(os, "getloadavg") else float("nan")
    tail = losses[-min(100, len(losses)):] if losses else [float("nan")]
    final_loss = sum(tail) / len(tail)

    # 4. held-out evaluation with transformers
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False, max_new_tokens=64
    )
    t_eval = time.time()
    ev = evaluate(model, tok, demo_tasks.demo_prompts(eval_prompts, seed=0)) if eval_prompts else None
    eval_seconds = time.time() - t_eval
    if ev:
        log(f"[train-demo] held-out exact match {ev['correct']}/{ev['n']} = {ev['accuracy']:.1%}  "
            f"per task {ev['per_task']}")
        for f in ev["failures"][:5]:
            log(f"[train-demo]   miss: {f}")

    stats = {
        "arch": "qwen3",
        "draft": draft,
        "shape": shape,
        "params": n_params,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "threads": threads,
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "total_seconds": round(time.time() - t0, 1),
        "final_loss": final_loss,
        "vocab_size": len(tok),
        "eval": ev,
        "torch": torch.__version__,
        "load_avg_after_training": round(load_after, 2),
    }

    # 5. save
    if save:
        model.save_pretrained(str(work), safe_serialization=True)
        add_legacy_rope_theta(work / "config.json", shape["rope_theta"])
        stats["dir_bytes"] = sum(f.stat().st_size for f in work.iterdir() if f.is_file())
        (work / "TRAINING.md").write_text(_training_md(stats))
        stats["dir_bytes"] = sum(f.stat().st_size for f in work.iterdir() if f.is_file())
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in _CHECKPOINT_FILES:
            old = out_dir / name
            if old.exists():
                old.unlink()
        for f in work.iterdir():
            shutil.move(str(f), str(out_dir / f.name))
            os.chmod(out_dir / f.name, 0o644)  # safetensors writes 0600
        work.rmdir()
        log(f"[train-demo] wrote {out_dir} ({stats['dir_bytes'] / 1e6:.2f} MB) in {stats['total_seconds']:.0f}s")
    else:
        shutil.rmtree(work)
    return stats


def _training_md(s: dict) -> str:
    ev = s.get("eval") or {}
    shape = s["shape"]
    per_task = ", ".join(f"{k} {v:.0%}" for k, v in (ev.get("per_task") or {}).items())
    lines = [
        "# minisgl demo draft model" if s["draft"] else "# minisgl demo model",
        "",
        *(["The draft model of speculative decoding for the demo model (the same tokenizer), the default",
           "draft of `speculative_algorithm=\"standalone\"` on the demo model.", ""] if s["draft"] else []),
        "A tiny Qwen3-style model trained by minisgl itself on the synthetic tasks of",
        "`minisgl/demo/tasks.py` (count, reverse, add, repeat). It answers held-out",
        "prompts exactly and then emits `<|eos|>`, so a request visibly stops at the",
        "right token. Rebuild it with:",
        "",
        "```",
        f"python -m minisgl train-demo --steps {s['steps']} --seed {s['seed']}" + (" --draft" if s["draft"] else ""),
        "```",
        "",
        "| stat | value |",
        "| --- | --- |",
        f"| architecture | `Qwen3ForCausalLM`, {shape['num_hidden_layers']} layers, hidden "
        f"{shape['hidden_size']}, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} kv heads, head_dim {shape['head_dim']}, "
        f"intermediate {shape['intermediate_size']}, tied embeddings |",
        f"| parameters | {s['params']:,} |",
        f"| vocabulary | {s['vocab_size']} (byte-level BPE, digits split) |",
        "| weights | float32, safetensors |",
        f"| optimizer | AdamW, peak lr {s['lr']}, warmup + cosine, batch {s['batch_size']} |",
        f"| steps | {s['steps']} |",
        f"| training time | {s['train_seconds']:.0f} s on {s['threads']} CPU threads (torch {s['torch']}, "
        f"{platform.machine()}; 5-minute load average {s.get('load_avg_after_training', float('nan')):.1f} "
        "at the end: above 2 means the cores were shared and the time is inflated) |",
        f"| final training loss | {s['final_loss']:.4f} (mean of the last 100 steps, answer tokens + EOS) |",
    ]
    if ev:
        lines.append(
            f"| held-out exact match | {ev['correct']}/{ev['n']} = {ev['accuracy']:.1%} "
            f"(`demo_prompts({ev['n']}, seed=0)`, transformers greedy `generate`, must end with EOS) |"
        )
        lines.append(f"| per task | {per_task} |")
    if "dir_bytes" in s:
        lines.append(f"| directory size | {s['dir_bytes'] / 1e6:.2f} MB |")
    lines += [
        "",
        "Held-out prompts (one in ten, chosen by a hash of the prompt text) are never",
        "trained on; `minisgl.demo.tasks.demo_prompts(n, seed)` draws from them.",
        "",
    ]
    return "\n".join(lines)


def parser():
    """train-demo's flags, each with its range (frontend/options.py)."""
    from ..frontend.options import SEED, Number, OneLineParser, count

    ap = OneLineParser(
        prog="python -m minisgl train-demo",
        description="Train the tiny demo model (CPU, a few minutes) and write a Hugging Face checkpoint.",
    )
    ap.add_argument("--out", default=None, help=f"output directory (default: {DEFAULT_OUT}, with --draft "
                    f"{DEFAULT_OUT / 'draft'})")
    ap.add_argument("--steps", type=count(MAX_STEPS), default=None,
                    help=f"training steps (default: {DEFAULT_STEPS}, with --draft {DRAFT_STEPS})")
    ap.add_argument("--draft", action="store_true", help="train the small draft model for speculative decoding")
    ap.add_argument("--seed", type=SEED, default=DEFAULT_SEED)
    ap.add_argument("--batch-size", type=count(MAX_BATCH_SIZE), default=64)
    ap.add_argument("--lr", type=Number(float, 0.0, 1.0, low_open=True), default=3e-3)
    ap.add_argument("--eval", type=count(MAX_EVAL, low=0), default=200,
                    help="held-out prompts to evaluate at the end (0: skip)")
    ap.add_argument("--threads", type=count(MAX_THREADS), default=2)
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m minisgl train-demo [--out DIR] [--steps N] [--seed S]``."""
    args = parser().parse_args(argv)
    stats = train_demo(
        args.out or (DEFAULT_OUT / "draft" if args.draft else DEFAULT_OUT),
        steps=args.steps or (DRAFT_STEPS if args.draft else DEFAULT_STEPS),
        draft=args.draft,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_prompts=args.eval,
        threads=args.threads,
    )
    ev = stats.get("eval")
    summary = {k: v for k, v in stats.items() if k != "eval"}
    if ev:
        summary["accuracy"] = ev["accuracy"]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
