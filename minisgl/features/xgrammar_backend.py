"""A second grammar backend beside the teaching FSM: xgrammar (SGLang's default), for JSON
schemas, any JSON, regular expressions and EBNF, behind the same delayed sampling.

An `XGrammar` constraint is compiled against the model's tokenizer once; each request gets its
own matcher (its state), advanced at commit like the FSM's state. Its mask is xgrammar's
token bitmask (one bit per vocabulary entry), filled on the host once the state is current
(DelayedSampling.launch) and applied to the logits on the device, in the engine's stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import xgrammar as xgr

from ..constraint import REJECTED, Constraint
from .grammar import TokenMask
from .json_schema_check import check_schema
from .json_text import JsonTextTokens


# xgrammar keeps every grammar it compiled unless told a size: a server would grow by each distinct
# grammar a client sends, refused or not, until it ran out of memory.
CACHE_LIMIT_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary (the model's rows, which may be more
    than the tokenizer's ids); xgrammar caches what it compiled, up to CACHE_LIMIT_BYTES (the
    least recently used go first). One thread a compile: the callers choose how many compiles run
    at once (the server's --grammar-workers), and xgrammar's default of 8 threads each would take
    the cores from the engine."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_limit_bytes)
        self.vocab_size = vocab_size
        self.json_text = JsonTextTokens(info.decoded_vocab, vocab_size)  # once a compiler: it reads the whole vocabulary

    def compile(self, kind: str, text: str = "") -> XGrammar:
        """kind: json_schema (text: the schema as JSON), json_object, regex or ebnf. A bad grammar
        is a ValueError."""
        try:
            if kind == "json_schema":
                check_schema(text)
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # any object, in JSON without free whitespace
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = self.compiler.compile_grammar(text)
            else:
                raise ValueError(f"unknown grammar kind {kind!r}: json_schema, json_object, regex or ebnf")
        except RuntimeError as exc:  # xgrammar's parse errors
            raise ValueError(f"invalid {kind}: {_reason(exc)}") from None
        return XGrammar(compiled, self.vocab_size, self.json_text if kind.startswith("json") else None)


def check_grammar(kind: str, text: str = "") -> None:
    """Parse a grammar without a tokenizer (cheap): a ValueError names what is wrong."""
    try:
        if kind == "json_schema":
            check_schema(text)
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
    except RuntimeError as exc:
        raise ValueError(f"invalid {kind}: {_reason(exc)}") from None


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", lines[0])


@dataclass
class MatcherState:
    """One request's place in an xgrammar grammar: its matcher (mutated in place), and where its
    text stands in a UTF-8 character (json_text.py; 0 unless the grammar is JSON)."""

    matcher: xgr.GrammarMatcher
    utf8: int = 0


class XGrammar(Constraint):
    """A compiled xgrammar grammar; its states are MatcherStates (one per request)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, json_text: JsonTextTokens | None = None) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.json_text = json_text  # a JSON grammar: what its text may hold beyond xgrammar's checks

    def initial_state(self) -> Any:
        return MatcherState(xgr.GrammarMatcher(self.compiled))

    def advance(self, state: Any, token: int) -> Any:
        if state is REJECTED or not state.matcher.accept_token(token):
            return REJECTED
        if self.json_text is not None:
            state.utf8 = self.json_text.after(state.utf8, token)
            if state.utf8 < 0:  # only a token the mask left out gets here
                return REJECTED
        return state

    def is_final(self, state: Any) -> bool:
        return state is not REJECTED and state.matcher.is_terminated()

    def validate(self, vocab: int) -> None:
        if self.vocab_size != vocab:
            raise ValueError(f"the grammar was compiled for a vocabulary of {self.vocab_size}, the model has {vocab}")

    @staticmethod
    def batch_mask(fsm: TokenMask, grammars: Sequence[Constraint | None], states: Sequence[Any]) -> BitmaskMask:
        """The batch's mask (features/grammar.py build_mask): the FSM rows', plus a bitmask row
        filled from each xgrammar request's matcher, on the host."""
        rows = tuple(i for i, g in enumerate(grammars) if isinstance(g, XGrammar) and states[i] is not REJECTED
                     and not states[i].matcher.is_terminated())
        vocab = next(g.vocab_size for g in grammars if isinstance(g, XGrammar))
        bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)  # all ones: nothing masked
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
            json_text = grammars[i].json_text
            if json_text is not None:
                bitmask[i] &= json_text.rows[states[i].utf8]
        return BitmaskMask(fsm, bitmask, rows)


@dataclass(frozen=True)
class BitmaskMask:
    """A batch's masks when some rows follow an xgrammar grammar: the FSM rows' TokenMask, and the
    bitmask of every row (all ones where xgrammar does not constrain)."""

    fsm: TokenMask
    bitmask: torch.Tensor  # [B, ceil(vocab / 32)] int32, on the host
    rows: tuple[int, ...]  # the rows xgrammar constrains

    @property
    def constrains(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor, to_device: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
        """Runs on the engine stream. A copy of the logits: the raw ones still give the logprobs."""
        masked = self.fsm.apply(logits, to_device) if self.fsm.constrains else logits.clone()
        xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device, non_blocking=True),
                                        indices=list(self.rows))
        return masked

