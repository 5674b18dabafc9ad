"""llama.cpp's pre-tokenizer settings per `tokenizer.ggml.pre` value: the regexes byte-level BPE
splits text with before merging (src/llama-vocab.cpp, llm_tokenizer_bpe), and the per-type
defaults llama.cpp attaches to them (ignore_merges, BOS, clean-up passes). Pure data; the
tokenizer (tokenizer.py) builds its HF pre-tokenizer from it."""

from __future__ import annotations

from dataclasses import dataclass

# ---- llama.cpp pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe) -----------------
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
RE_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
            r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
RE_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
RE_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """llama.cpp's settings for one `tokenizer.ggml.pre` value."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False        # default when the GGUF has no tokenizer.ggml.add_bos_token
    clean_spaces: bool = True    # llama_detokenize's clean-up passes
    no_bos: bool = False         # chatglm: llama.cpp clears the default BOS id


_DEFAULT = PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_STARCODER = PreTokenizerSpec((r"\p{N}", RE_GPT2))
_STARCODER_NC = PreTokenizerSpec((r"\p{N}", RE_GPT2), clean_spaces=False)
_GPT2 = PreTokenizerSpec((RE_GPT2,))
_GPT2_NC = PreTokenizerSpec((RE_GPT2,), clean_spaces=False)
_LLAMA3 = PreTokenizerSpec((RE_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_PLAIN = PreTokenizerSpec((RE_LLAMA3,))
_QWEN2 = PreTokenizerSpec((RE_QWEN2,), clean_spaces=False)
_BLOOM = PreTokenizerSpec((RE_BLOOM,))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _DEFAULT,
    # \p{N} isolated, then GPT-2 (LLAMA_VOCAB_PRE_TYPE_STARCODER group)
    "starcoder": _STARCODER, "refact": _STARCODER, "codeshell": _STARCODER, "exaone": _STARCODER,
    "minerva-7b": _STARCODER, "mellum2": _STARCODER,
    "smollm": _STARCODER_NC, "command-r": _STARCODER_NC,
    # GPT-2 regex only
    "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "jina-es": _GPT2, "jina-de": _GPT2, "gigachat": _GPT2,
    "jina-v2-es": _GPT2, "jina-v2-de": _GPT2, "a.x-4.0": _GPT2, "mellum": _GPT2, "modern-bert": _GPT2,
    "exaone4": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "trillion": _GPT2_NC, "granite-docling": _GPT2_NC,
    # llama3 regex, ignore_merges, BOS by default
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3,
    "dbrx": _LLAMA3_PLAIN, "smaug-bpe": _LLAMA3_PLAIN,
    "chatglm-bpe": PreTokenizerSpec((RE_LLAMA3,), no_bos=True),
    "glm4": PreTokenizerSpec((RE_LLAMA3,), no_bos=True),
    # qwen2 regex (single digits)
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2, "hunyuan": _QWEN2,
    "solar-open": _QWEN2, "stablelm2": PreTokenizerSpec((RE_QWEN2,)), "megrez": PreTokenizerSpec((RE_QWEN2,)),
    "grok-2": _QWEN2,
    "qwen35": PreTokenizerSpec((RE_QWEN35,), clean_spaces=False),
    # others with plain regexes
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizerSpec(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
                                       clean_spaces=False),
    "deepseek-v3": PreTokenizerSpec((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                                     r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                                     r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                                    clean_spaces=False),
    "tekken": PreTokenizerSpec((RE_TEKKEN,), ignore_merges=True, add_bos=True, clean_spaces=False),
    "gpt-4o": PreTokenizerSpec((RE_GPT4O,), clean_spaces=False),
    "llama4": PreTokenizerSpec((RE_GPT4O,), clean_spaces=False),
    "bloom": _BLOOM, "gpt3-finnish": _BLOOM, "poro-chat": PreTokenizerSpec((RE_BLOOM,), clean_spaces=False),
    "viking": PreTokenizerSpec((RE_BLOOM, r"\p{N}"), clean_spaces=False),
    "seed-coder": PreTokenizerSpec((RE_SEED_CODER,), clean_spaces=False),
    "bailingmoe": PreTokenizerSpec((RE_BAILINGMOE,), clean_spaces=False),
    "bailingmoe2": PreTokenizerSpec((RE_BAILINGMOE,), clean_spaces=False),
    "llada-moe": PreTokenizerSpec((RE_BAILINGMOE,), clean_spaces=False),
}
