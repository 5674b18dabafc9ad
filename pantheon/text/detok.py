"""Streaming detokenization that never emits half a UTF-8 character.

Each token maps to the raw bytes llama.cpp's `token_to_piece` gives it (a precomputed table on the
Tokenizer); the bytes go through an incremental UTF-8 decoder, which returns only complete
characters and holds back an incomplete tail until the next token completes it. A byte sequence
that can never become valid UTF-8 comes out as U+FFFD, exactly as `bytes.decode("utf-8",
"replace")` would render the whole stream, so the concatenation of everything `push` and `flush`
return equals `Tokenizer.decode(ids, clean_spaces=False)` for the same ids (for SPM vocabularies
pass `strip_leading_space=True` to also match decode's removal of the first token's leading space).

This is what llama-server streams: per-token pieces, without llama_detokenize's clean_spaces
passes (which are off anyway for smollm, qwen2, qwen35 and SPM vocabularies).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class IncrementalDetokenizer:
    def __init__(self, tokenizer, unparse_special: bool = True, strip_leading_space: bool = False):
        self._table = tokenizer.piece_table(unparse_special)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = strip_leading_space
        self._first = True

    def push(self, token_id: int) -> str:
        """Feed one token; return the text it completed (may be '')."""
        try:
            data = self._table[token_id] if token_id >= 0 else None
        except IndexError:
            data = None
        if data is None:
            raise ValueError(f"token id {token_id} out of range [0, {len(self._table)})")
        if self._first:
            self._first = False
            if self._strip and data[:1] == b" ":
                data = data[1:]
        return self._decoder.decode(data) if data else ""

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they do not yet form a complete character."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        """End of stream: whatever is still held back (an incomplete tail becomes U+FFFD)."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out
