"""Tiny random checkpoints for tests, lessons and benchmarks.

Everything here runs offline.  A checkpoint written by :func:`make_tiny` is an
ordinary Hugging Face directory (``config.json``, ``generation_config.json``,
``model.safetensors`` and the tokenizer files), so both ``transformers`` and
minisgl's own loader can read it.

Four presets exist (``"small"``: head_dim 128 for the CUDA tests):

``"tiny"``
    A few hundred thousand parameters; builds in well under a second.  The
    weights are random, so the text it generates is gibberish -- use it to
    check shapes, plumbing and token-for-token agreement with ``transformers``.
``"qwen3-0.6b"``
    The exact tensor shapes of Qwen3-0.6B in bfloat16 with random weights, for
    benchmarks that care about realistic sizes but not about the text.
``"qwen3-8b"``
    The same for Qwen3-8B: about 16 GB of bfloat16, so build it on a GPU
    (``device="cuda"``); on the CPU it takes minutes.

The tokenizer is a byte-level BPE trained on a short built-in English text
(plus the demo-task corpus), so it is small (about 512 entries) but encodes
any string.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable

import torch

__all__ = [
    "SPECIAL_TOKENS",
    "ARCHS",
    "PRESETS",
    "train_bpe_tokenizer",
    "make_tiny",
    "tiny_config",
    "builtin_text",
]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
ARCHS = ("llama", "qwen2", "qwen3")

# Shapes of each preset: (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, window, rope
# theta, tied embeddings, dtype); a vocab of None means "the tokenizer's size". "small" has head_dim
# 128 and GQA group 2, like Qwen3-0.6B: what FlashInfer's kernels support on a GPU.
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
               "dtype")
PRESETS: dict[str, dict] = {name: dict(zip(_SHAPE_KEYS, shape)) for name, shape in {
    "tiny": (64, 2, 4, 2, 16, 128, None, 2048, 10000.0, False, "float32"),
    "small": (512, 2, 4, 2, 128, 1024, None, 4096, 10000.0, False, "float32"),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, 40960, 1_000_000.0, True, "bfloat16"),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, 40960, 1_000_000.0, False, "bfloat16"),
}.items()}

# A short, original English text used to train the tiny tokenizer.  It only
# needs to contain ordinary words, digits and punctuation.
_BUILTIN_TEXT = """\
An inference engine turns a trained model into a service. Requests arrive one
by one, each with a prompt and a few sampling settings, and the engine has to
answer all of them as quickly as the hardware allows. The model itself is only
a function from a list of token ids to a score for every possible next token.
Everything else, from batching to memory management, belongs to the engine.

The first step of every request is the prefill. The prompt is split into
tokens, the tokens are run through the network together, and the keys and
values of every attention layer are written into a cache. After the prefill
the engine decodes: it picks one new token, feeds it back in, and reads the
cached keys and values instead of recomputing them. A request finishes when
the model emits the end-of-sequence token or when it reaches its length limit.

Running one request at a time wastes the machine. A scheduler therefore keeps
a batch of running requests and adds new ones as soon as memory frees up. On a
graphics card the expensive part is the forward pass, while the small jobs in
between, such as choosing the next batch, copying results back and checking
stop conditions, are done by the processor. If the processor and the card wait
for each other, both sit idle for part of every step.

The overlap scheduler hides that gap. While the card computes step seven, the
processor already prepares step eight, using placeholders for tokens it has
not seen yet. When the results of step seven arrive, the placeholders are
resolved and finished requests are removed one step later. The idea is simple,
but the details matter: a request must stop at exactly the right token, memory
must be returned exactly once, and the output must match a plain loop token
for token.

Numbers appear everywhere in such a system: 1 batch, 2 streams, 8 layers,
16 heads, 32 tokens per page, 64 requests, 128 slots, 256 bytes, 512 entries,
1024 features, 2048 positions, 4096 contexts, and 10 or 20 or 30 milliseconds
per step. Questions like "How fast is it?", "Is it correct?" and "What broke?"
are answered by measuring; a good teacher shows the numbers (and the code).
"""


def builtin_text() -> str:
    """The short English text the tiny tokenizer is trained on."""
    return _BUILTIN_TEXT


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------

# Word splitting of the Qwen2/Qwen3 tokenizers (contractions, a letter run with
# at most one leading non-letter, single digits, punctuation runs, whitespace).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    model_max_length: int = 2048,
):
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``out_dir``.

    * Byte-level: every string can be encoded (no unknown token).
    * Split into words like Qwen's tokenizer: a word keeps its leading space or
      punctuation mark, and digits are split one by one (numbers are spelled
      digit by digit).
    * Special tokens ``<|bos|>`` (id 0), ``<|eos|>`` (id 1), ``<|pad|>`` (id 2).
    * No token is added automatically: ``encode(prompt)`` is exactly the ids of
      the prompt text.

    Returns the ``transformers`` fast tokenizer; ``AutoTokenizer.from_pretrained(out_dir)``
    loads the same one offline.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as Qwen2/Qwen3 tokenizers: transformers
    # 5 rebuilds exactly this pipeline when it loads a "qwen2" checkpoint, so
    # every loader sees the same token boundaries.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes "TokenizersBackend"; the older name loads in 4.x and 5.x alike.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Without an explicit null, transformers' Qwen2Tokenizer adds "<|endoftext|>"
    # as an unknown token (a byte-level BPE never needs one).
    cfg["unk_token"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return fast


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _classes(arch: str):
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2Config, Qwen2ForCausalLM
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3Config, Qwen3ForCausalLM
    raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")


def tiny_config(
    arch: str = "qwen3",
    preset: str = "tiny",
    *,
    vocab_size: int | None = None,
    bos_token_id: int = 0,
    eos_token_id: int = 1,
    pad_token_id: int = 2,
    dtype: str | None = None,
    init_std: float = 0.02,
):
    """The ``transformers`` config that :func:`make_tiny` uses (no weights)."""
    config_cls, _ = _classes(arch)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    p = dict(PRESETS[preset])
    dtype = dtype or p.pop("dtype")
    p.pop("dtype", None)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    if p["vocab_size"] is None:
        if vocab_size is None:
            raise ValueError("preset needs vocab_size (the tokenizer's size)")
        p["vocab_size"] = vocab_size
    head_dim = p.pop("head_dim")
    rope_theta = p.pop("rope_theta")
    kwargs = dict(
        p,
        head_dim=head_dim,
        rope_theta=rope_theta,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        attention_bias=(arch == "qwen2"),  # Qwen2 has q/k/v biases; Llama and Qwen3 do not
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    if arch == "qwen2" and head_dim * p["num_attention_heads"] != p["hidden_size"]:
        raise ValueError("qwen2 needs head_dim * num_attention_heads == hidden_size")
    if arch == "qwen2":
        kwargs.pop("head_dim")
        kwargs.pop("attention_bias")
    config = config_cls(**kwargs)
    config.dtype = _DTYPES[dtype]
    return config


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def add_legacy_rope_theta(config_path: Path, rope_theta: float) -> None:
    """Also write the top-level ``rope_theta`` key older readers look for.

    transformers 5 keeps it under ``rope_parameters``; published Qwen/Llama
    configs (and simple loaders) use the flat key.  Both are kept in sync.
    """
    cfg = json.loads(config_path.read_text())
    cfg.setdefault("rope_theta", rope_theta)
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny(
    out_dir: str | Path,
    arch: str = "qwen3",
    *,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    config_only: bool = False,
    init_std: float = 0.02,
    device: str = "cpu",
) -> Path:
    """Write a checkpoint with random weights to ``out_dir`` and return its path.

    ``arch`` is ``"llama"``, ``"qwen2"`` or ``"qwen3"`` (the model classes come
    from ``transformers`` itself).  ``preset`` is ``"tiny"`` or
    ``"qwen3-0.6b"`` (see :data:`PRESETS`).  ``dtype`` defaults to the
    preset's (``float32`` for tiny, ``bfloat16`` for qwen3-0.6b).  The same
    ``seed`` gives the same weights on the same ``device`` (the random
    weights are drawn there: ``"cuda"`` for the large presets).  ``config_only=True`` writes the config,
    generation config and tokenizer but no weights (cheap even for the large
    preset).
    """
    from transformers import GenerationConfig

    _classes(arch)  # validate arch first
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    from .tasks import tokenizer_corpus

    texts = [builtin_text()] + tokenizer_corpus(seed=1234)
    tok = train_bpe_tokenizer(texts, 512, out_dir)
    ids = dict(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config = tiny_config(arch, preset, vocab_size=len(tok), dtype=dtype, init_std=init_std, **ids)
    torch_dtype = config.dtype
    rope_theta = PRESETS[preset]["rope_theta"]

    gen = GenerationConfig(**ids, do_sample=False, max_new_tokens=64)

    if config_only:
        config.save_pretrained(str(out_dir))
        gen.save_pretrained(str(out_dir))
        add_legacy_rope_theta(out_dir / "config.json", rope_theta)
        return out_dir

    _, model_cls = _classes(arch)
    torch.manual_seed(seed)
    # Build the parameters directly in the target dtype: a large preset never exists in float32.
    with _default_dtype(torch_dtype), torch.device(device):
        model = model_cls(config)
    model.eval()
    model.generation_config = gen
    model.save_pretrained(str(out_dir), safe_serialization=True)
    add_legacy_rope_theta(out_dir / "config.json", rope_theta)
    del model
    return out_dir


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m minisgl.demo.tiny", description="write a random checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="qwen3", choices=ARCHS)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, choices=sorted(_DTYPES))
    ap.add_argument("--config-only", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda for qwen3-8b)")
    a = ap.parse_args(argv)
    path = make_tiny(a.out_dir, a.arch, preset=a.preset, seed=a.seed, dtype=a.dtype, config_only=a.config_only,
                     device=a.device)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
