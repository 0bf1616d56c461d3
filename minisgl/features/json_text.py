"""What JSON text may hold, token by token, beyond what xgrammar 0.2.9 checks (features/xgrammar_backend.py).

Two holes in its JSON schema grammars let a model that samples raw bytes return text the schema
does not describe: a string with maxLength or minLength is compiled to a character class that admits
raw control characters (xgrammar issue #800: JSON that strict parsers refuse), and any string takes
the bytes of a UTF-16 surrogate (ED A0-BF xx, which is not UTF-8) as one character (three U+FFFD
in the text, past a maxLength). JSON text is UTF-8 with no raw control character anywhere in the
grammars here (they allow no free whitespace, and a string holds them escaped only), so a JSON
grammar's mask is ANDed with the row of the tokens that keep it so: the row depends on where the
text stands in a UTF-8 character (`Utf8` states), which each request's state follows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

# Where text stands in a UTF-8 character (RFC 3629): 0 at a boundary; else which bytes the rest of
# the character may take, as (lowest, highest, the state after it).
UTF8_REST = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2),
             4: (0xA0, 0xBF, 1),  # after E0: no overlong form
             5: (0x80, 0x9F, 1),  # after ED: no surrogate
             6: (0x90, 0xBF, 2),  # after F0: no overlong form
             7: (0x80, 0x8F, 2)}  # after F4: nothing past U+10FFFF
UTF8_STATES = 8
INVALID = -1
RESTRICTED_LEADS = {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}  # first bytes whose next byte has a narrower range


def utf8_step(state: int, byte: int) -> int:
    """The state after one more byte, INVALID where UTF-8 does not allow it."""
    if state in UTF8_REST:
        low, high, after = UTF8_REST[state]
        return after if low <= byte <= high else INVALID
    if byte < 0x80:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte in RESTRICTED_LEADS:
        return RESTRICTED_LEADS[byte]
    if 0xE1 <= byte <= 0xEF:
        return 2
    if 0xF1 <= byte <= 0xF3:
        return 3
    return INVALID  # 80-BF, C0, C1, F5-FF: never a character's first byte


class JsonTextTokens:
    """For one vocabulary: from each UTF-8 state, the state after each token (`next_state`,
    INVALID where the token breaks UTF-8 or holds a raw control character), and the same as
    bitmask rows in xgrammar's layout (bit j of word k is token 32k + j)."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        step = [[utf8_step(s, b) for b in range(256)] for s in range(UTF8_STATES)]
        for s in range(UTF8_STATES):
            for b in range(0x20):
                step[s][b] = INVALID  # a raw control character: JSON allows it nowhere
        words = -(-vocab_size // 32)
        self.next_state = np.full((UTF8_STATES, words * 32), INVALID, dtype=np.int8)
        self.next_state[:, vocab_size:] = 0  # rows past the tokenizer's: xgrammar's own mask leaves them out
        for token, text in enumerate(decoded_vocab[:vocab_size]):
            for start in range(UTF8_STATES):
                state = start
                for byte in text:
                    state = step[state][byte]
                    if state == INVALID:
                        break
                self.next_state[start, token] = state
        allowed = self.next_state != INVALID
        self.rows = torch.from_numpy(np.packbits(allowed, axis=1, bitorder="little").view("<i4").astype(np.int32))

    def after(self, state: int, token: int) -> int:
        return int(self.next_state[state, token])
