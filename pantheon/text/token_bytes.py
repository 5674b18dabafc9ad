"""The bytes behind vocabulary entries, as llama.cpp reads them: GPT-2's byte-level character map
(the form GGUF byte-level vocabularies use), SentencePiece's `<0xXX>` byte tokens, and
llama_detokenize's clean_spaces passes. Used by the tokenizer (tokenizer.py) to build its per-id
byte table and to detokenize."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the form GGUF byte-level vocabs use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def byte_level_decode(text: str) -> bytes:
    # A character outside GPT-2's byte map cannot come from byte-level encoding; llama.cpp emits an
    # "[UNK_BYTE_0x..]" marker there, we keep the character's UTF-8 instead.
    out = bytearray()
    for ch in text:
        b = _UNICODE_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def parse_byte_token(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def clean_spaces(s: bytes) -> bytes:
    """llama_detokenize's three clean_spaces passes (on bytes, exactly as llama.cpp does them)."""
    if len(s) < 2:
        return s
    # 1: " ?", " !", " .", " ," -> drop the space
    out = bytearray(s[:1])
    for i in range(1, len(s)):
        x = s[i]
        if s[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    s = bytes(out)
    # 2: " ' " -> "'" (llama.cpp also overwrites the second space with NUL in its buffer, which the
    # next step's look-behind then sees; reading from `buf` reproduces that)
    buf = bytearray(s)
    out = bytearray(buf[:1])
    i, n = 1, len(buf)
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            out.pop()
            buf[i + 1] = 0
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    s = bytes(out)
    # 3: " 's", " 'm", " 're", " 've" -> drop the space
    out = bytearray(s[:1])
    n = len(s)
    for i in range(1, n):
        x = s[i]
        if s[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = s[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n:
                x2 = s[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):
                    out.pop()
        out.append(x)
    return bytes(out)
