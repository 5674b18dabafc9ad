"""llama.cpp-exact tokenizer for GGUF vocabularies.

What runs where:

* Special-token partition (our Python, `_partition`): the text is split around special tokens
  exactly the way llama.cpp's `tokenizer_st_partition` does it: the candidates are the tokens
  with the CONTROL, USER_DEFINED or UNKNOWN attribute, processed longest text first, each one
  cut out of every remaining raw-text fragment. CONTROL/UNKNOWN tokens only take part with
  `parse_special=True`; USER_DEFINED tokens always do (as in llama.cpp and HF).
* Raw-text fragments:
  - byte-level BPE (`tokenizer.ggml.model == "gpt2"`) go to an HF `tokenizers.Tokenizer` with no
    added tokens: `Split(regex, "isolated")` for each of llama.cpp's regexes for
    `tokenizer.ggml.pre` (applied in sequence, unmatched spans kept as their own pieces, like
    `unicode_regex_split`), then `ByteLevel(use_regex=False)`, then `BPE(vocab, merges,
    ignore_merges=...)`. GGUF byte-level vocabularies are already in GPT-2 `bytes_to_unicode`
    form, so tokens and merges go in unchanged.
  - SentencePiece (`tokenizer.ggml.model == "llama"`) run llama.cpp's own score-ordered merging
    (`text/spm.py`) after its escaping: "▁" prefixed (when add_space_prefix) to every raw
    fragment, each of which starts the text or follows a special token, and spaces made "▁".
* Decoding never goes through HF: a per-id byte table reproduces llama.cpp's `token_to_piece`
  and `llama_detokenize` (leading-space strip for SPM, `clean_spaces` passes for the pre-types
  where llama.cpp enables them).

Unknown `tokenizer.ggml.model` or `tokenizer.ggml.pre` raise `ValueError` (llama.cpp refuses to
load such files too). A *missing* `tokenizer.ggml.pre` falls back to llama.cpp's "default"
regex set with a warning, which is what llama.cpp does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pantheon.gguf.reader import shown
from pantheon.text.pretokenizers import PRE_TOKENIZERS, PreTokenizerSpec
from pantheon.text.spm import SentencePiece
from pantheon.text.token_bytes import byte_level_decode, parse_byte_token
from pantheon.text.token_bytes import clean_spaces as clean_space_passes

log = logging.getLogger(__name__)

# ---- token attributes (same bit values as llama.cpp's llama_token_attr) ----------------------
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# GGUF tokenizer.ggml.token_type values -> attributes
_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

# Texts llama.cpp auto-detects (first match only) when the id is not given in the GGUF.
# Whatever is detected is forced to CONTROL.
_AUTO_DETECT: dict[str, tuple[str, ...]] = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
            "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# Texts that are always end-of-generation (and forced to CONTROL) in llama.cpp.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})

# gpt-oss: llama.cpp always renders these (USER_DEFINED).
_FORCE_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

# GGUF key suffix -> our special-id name. Later keys of the same name are the deprecated aliases.
_SPECIAL_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"), ("eom_token_id", "eom"),
    ("unknown_token_id", "unk"), ("seperator_token_id", "sep"), ("padding_token_id", "pad"),
    ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"), ("fim_mid_token_id", "fim_mid"),
    ("fim_pad_token_id", "fim_pad"), ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"), ("middle_token_id", "fim_mid"),
)

_C_ISSPACE = " \t\n\v\f\r"

class Tokenizer:
    """A GGUF vocabulary with llama.cpp's tokenize/detokenize semantics (see the module doc)."""

    def __init__(self, meta: Mapping[str, Any]):
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {shown(model)}: supported are 'gpt2' "
                             f"(byte-level BPE) and 'llama' (SentencePiece)")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        self.model: str = model
        self.is_spm = model == "llama"

        # -- vocabulary --------------------------------------------------------------------
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        token_to_id: dict[str, int] = {}
        for i, t in enumerate(texts):
            if t in token_to_id:
                raise ValueError(f"duplicate token in vocabulary: {shown(t)} has ids {token_to_id[t]} and {i}")
            token_to_id[t] = i
        self._texts = texts
        self._token_to_id = token_to_id

        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        attrs = [ATTR_NORMAL] * n if types is None else [_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED)
                                                         for t in types[:n]]
        scores = meta.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < n:
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")

        # -- per-type settings ---------------------------------------------------------------
        if self.is_spm:
            self.pre = None
            spec = None
            self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            add_bos_default, self.clean_spaces = True, False
            special = {"bos": 1, "eos": 2, "unk": 0}
        else:
            pre = meta.get("tokenizer.ggml.pre")
            if not pre:
                log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                            "(generation quality may be degraded)")
                pre = "default"
            spec = PRE_TOKENIZERS.get(pre)
            if spec is None:
                raise ValueError(f"unsupported tokenizer.ggml.pre {shown(pre)} (supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))})")
            self.pre = pre
            self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
            add_bos_default, self.clean_spaces = spec.add_bos, spec.clean_spaces
            special = {"bos": 11, "eos": 11}
            if spec.no_bos:
                special.pop("bos")
        self.pre_spec = spec

        for key, name in _SPECIAL_KEYS:
            if name in special and not 0 <= special[name] < n:
                special.pop(name)  # default id out of range: disabled
            v = meta.get(f"tokenizer.ggml.{key}")
            if v is None:
                continue
            if 0 <= int(v) < n:
                special[name] = int(v)
            else:
                log.warning("bad special token id tokenizer.ggml.%s = %s (vocab has %d), ignored", key, v, n)
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and "bos" not in special:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but there is no BOS token id")
        if self.add_eos and "eos" not in special:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but there is no EOS token id")

        # -- llama.cpp's text-based auto-detection, forced CONTROL and the EOG set ------------------
        # (llama.cpp walks an unordered_map; when several texts match we take the lowest id)
        for name, candidates in _AUTO_DETECT.items():
            if name in special:
                continue
            hits = [token_to_id[c] for c in candidates if c in token_to_id]
            if hits:
                tid = min(hits)
                special[name] = tid
                attrs[tid] |= ATTR_CONTROL
        eog: set[int] = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in special}
        for t in EOG_TEXTS:
            tid = token_to_id.get(t)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        for t in _FORCE_USER_DEFINED:
            tid = token_to_id.get(t)
            if tid is not None:
                attrs[tid] = ATTR_USER_DEFINED
        eog.update(special[k] for k in ("eos", "eot", "eom") if k in special)
        eog_texts = {texts[i] for i in eog}
        has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
        if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
            tid = token_to_id["<|end|>"]  # gpt-oss / solar-open: <|end|> is not EOG
            eog.discard(tid)
            attrs[tid] = ATTR_USER_DEFINED
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            tid = token_to_id["</s>"]  # gemma4
            eog.discard(tid)
            attrs[tid] = ATTR_NORMAL
        self._special = special
        self._eog = frozenset(eog)

        # model-name specific strip attributes (llama.cpp: phi-3 rstrip, jina/modern-bert mask lstrip)
        name = str(meta.get("general.name", "")).lower()
        arch = str(meta.get("general.architecture", ""))
        pre_s = str(meta.get("tokenizer.ggml.pre", ""))
        if any(s in pre_s for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in token_to_id:
                attrs[token_to_id["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i, a in enumerate(attrs):
                if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                    attrs[i] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if t in token_to_id:
                    i = token_to_id[t]
                    attrs[i] = attrs[i] | ATTR_RSTRIP if on else attrs[i] & ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in token_to_id:
            attrs[token_to_id["[MASK]"]] |= ATTR_LSTRIP
        self._attrs = attrs

        # -- special-token partition candidates, longest text first ------------------------------
        cands = [i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        cands.sort(key=lambda i: (-len(texts[i].encode("utf-8")), i))
        self._st_all = [(texts[i], i, attrs[i]) for i in cands]
        self._st_user = [(t, i, a) for (t, i, a) in self._st_all if not a & (ATTR_CONTROL | ATTR_UNKNOWN)]

        # -- byte tables (token_to_piece with special=True / False) -------------------------------
        pieces = []
        for i in range(n):
            a, t = attrs[i], texts[i]
            if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                p = t.encode("utf-8")
            elif a & ATTR_NORMAL:
                p = t.replace("▁", " ").encode("utf-8") if self.is_spm else byte_level_decode(t)
            elif a & ATTR_BYTE:
                b = parse_byte_token(t)
                p = bytes([b]) if b is not None else b""
            else:  # UNUSED / UNDEFINED: llama.cpp renders nothing
                p = b""
            pieces.append(p)
        self._pieces = pieces
        self._pieces_nospecial = [b"" if attrs[i] & (ATTR_UNKNOWN | ATTR_CONTROL) else p
                                  for i, p in enumerate(pieces)]

        # -- raw-text fragments: llama.cpp's SentencePiece session, or an HF byte-level BPE ----------
        if self.is_spm:
            self._spm = SentencePiece(token_to_id, scores, special.get("unk"))
            self._hf = None
        else:
            self._spm = None
            self._hf = self._build_bpe(token_to_id, meta.get("tokenizer.ggml.merges"), spec)

    # ---- builders ----------------------------------------------------------------------------
    def _build_bpe(self, token_to_id, merges_raw, spec: PreTokenizerSpec) -> HFTokenizer:
        if not merges_raw:
            raise ValueError("byte-level BPE GGUF has no tokenizer.ggml.merges")
        merges, seen = [], set()
        for m in merges_raw:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            # llama.cpp keeps the first rank of a duplicated pair; a pair whose halves or result are
            # not tokens can never produce a vocabulary token, and HF's BPE rejects it
            if (a, b) in seen or a not in token_to_id or b not in token_to_id or a + b not in token_to_id:
                continue
            seen.add((a, b))
            merges.append((a, b))
        bpe = models.BPE(vocab=dict(token_to_id), merges=merges, ignore_merges=spec.ignore_merges)
        tk = HFTokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
        return tk

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        return cls(meta)

    @classmethod
    def from_gguf(cls, g) -> Tokenizer:
        return cls(g.metadata)

    # ---- properties ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def bos_id(self) -> int | None:
        return self._special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self._special.get("eos")

    @property
    def eot_id(self) -> int | None:
        return self._special.get("eot")

    @property
    def unk_id(self) -> int | None:
        return self._special.get("unk")

    @property
    def pad_id(self) -> int | None:
        return self._special.get("pad")

    @property
    def eog_ids(self) -> frozenset[int]:
        """llama.cpp's end-of-generation set (llama_vocab_is_eog)."""
        return self._eog

    def special_id(self, name: str) -> int | None:
        """bos, eos, eot, eom, unk, sep, pad, mask, fim_pre/suf/mid/pad/rep/sep (None if absent)."""
        return self._special.get(name)

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[self._check(token_id)] & ATTR_CONTROL)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    def token_attr(self, token_id: int) -> int:
        return self._attrs[self._check(token_id)]

    def token_text(self, token_id: int) -> str:
        """The vocabulary string as stored in the GGUF (byte-level form, e.g. 'Ġthe')."""
        return self._texts[self._check(token_id)]

    def token_to_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for (control tokens: their UTF-8 text)."""
        return self._pieces[self._check(token_id)]

    def piece_table(self, unparse_special: bool = True) -> list[bytes]:
        """token_to_piece for every id; with unparse_special=False control/unknown tokens are b''."""
        return self._pieces if unparse_special else self._pieces_nospecial

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._texts):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._texts)})")
        return token_id

    # ---- tokenize ---------------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        frags: list[str | int] = [text]
        for st, tid, attr in (self._st_all if parse_special else self._st_user):
            if st not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or st not in f:
                    out.append(f)
                    continue
                pos = 0
                while True:
                    m = f.find(st, pos)
                    if m < 0:
                        break
                    left = f[pos:m]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_ISSPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = m + len(st)
                    if attr & ATTR_RSTRIP:
                        while pos < len(f) and f[pos] in _C_ISSPACE:
                            pos += 1
                if pos < len(f):
                    out.append(f[pos:])
            frags = out
        return frags

    def encode(self, text: str, parse_special: bool = True, add_bos: bool | None = None,
               add_eos: bool | None = None) -> list[int]:
        """llama_tokenize. add_bos/add_eos None = the model's default (tokenizer.ggml.add_bos_token,
        else per type: SPM and llama3-family true, others false; add_eos default false)."""
        if add_bos is None:
            add_bos = self.add_bos
        if add_eos is None:
            add_eos = self.add_eos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        if text:
            spm, prefix = self._spm, "▁" if self.add_space_prefix else ""
            for f in self._partition(text, parse_special):
                if isinstance(f, int):
                    out.append(f)
                elif spm is not None:  # a raw fragment starts the text or follows a special token
                    spm.tokenize((prefix + f).replace(" ", "▁"), out)
                else:
                    out.extend(self._hf.encode(f, add_special_tokens=False).ids)
        if add_eos:
            if self.eos_id is None:
                raise ValueError("add_eos requested but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    def encode_batch(self, texts: Sequence[str], parse_special: bool = True,
                     add_bos: bool | None = None) -> list[list[int]]:
        return [self.encode(t, parse_special, add_bos) for t in texts]

    # ---- detokenize -------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int], unparse_special: bool = True, remove_special: bool = False,
                     clean_spaces: bool | None = None) -> bytes:
        """llama_detokenize, as bytes."""
        ids = list(ids)
        table = self._pieces if unparse_special else self._pieces_nospecial
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        n = len(table)
        for t in ids:
            if not 0 <= t < n:
                raise ValueError(f"token id {t} out of range [0, {n})")
        parts = [table[t] for t in ids]
        if remove_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        if self.clean_spaces if clean_spaces is None else clean_spaces:
            data = clean_space_passes(data)
        return data

    def decode(self, ids: Iterable[int], unparse_special: bool = True, remove_special: bool = False,
               clean_spaces: bool | None = None) -> str:
        """llama_detokenize(ids, remove_special, unparse_special). unparse_special=False drops control
        (and unknown) tokens. clean_spaces None = llama.cpp's per-pre-type default (off for smollm,
        qwen2, qwen35 and SPM; on for gpt-2/llama3/starcoder). Invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, unparse_special, remove_special, clean_spaces).decode("utf-8", "replace")

    def __repr__(self) -> str:
        kind = "spm" if self.is_spm else f"bpe/{self.pre}"
        return f"Tokenizer({kind}, n_vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, " \
               f"eog={sorted(self._eog)})"
