"""A checkpoint's tokenizer and end-of-sequence ids, as LLM loads them."""

from __future__ import annotations

from pathlib import Path

from ..models.checkpoint import read_json_object


def check_tokenizer_fits(tokenizer, vocab_size: int, model_path: Path) -> None:
    """A tokenizer whose ids reach past the embedding's rows is allowed (real checkpoints pad
    or trim either one), but its text must never reach the device with such an id: the
    embedding lookup would fail there and stop the engine for every request. _tokenize()
    checks each prompt; here the tokenizer's special tokens, which would make every prompt
    fail, are checked once."""
    if tokenizer is None:
        return
    special = [i for i in tokenizer.all_special_ids if i is not None and not 0 <= i < vocab_size]
    if special:
        raise ValueError(f"the tokenizer in {str(model_path)!r} has special token ids {special[:8]} outside the "
                         f"model's vocabulary of {vocab_size} (config.json vocab_size): tokenizer and weights "
                         f"do not belong together")


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    if not (model_path / "tokenizer.json").exists() and not (model_path / "tokenizer_config.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except Exception as exc:  # the tokenizers library raises its own types for a corrupt file
        raise ValueError(f"cannot load the tokenizer in {str(model_path)!r}: {exc}") from exc


def eos_ids(config, tokenizer, model_path: Path) -> frozenset[int]:
    """The ids that end a request: config.json's and generation_config.json's eos_token_id (an id
    or a list of them) and the tokenizer's. One ValueError naming the file for an id that is not
    a token of the model (-5 or 10**30 would never be generated: such a request never stops)."""
    vocab = config.vocab_size
    ids: set[int] = set()

    def add(value: object, source: str) -> None:
        if value is None:
            return
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
                raise ValueError(f"{source}: eos_token_id {value!r} is not a token id of this model "
                                 f"(an integer in 0..{vocab - 1}, or a list of them)")
            ids.add(v)

    add(getattr(config, "eos_token_id", None), repr(str(model_path / "config.json")))
    gen_config = model_path / "generation_config.json"
    if gen_config.exists():
        add(read_json_object(gen_config).get("eos_token_id"), repr(str(gen_config)))
    if tokenizer is not None:
        add(tokenizer.eos_token_id, f"the tokenizer in {str(model_path)!r}")
    return frozenset(ids)
