"""Rebuild a tokenizers-library tokenizer from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary. The MLX engine
must tokenize exactly as llama.cpp does on the same file, so every choice here mirrors
llama.cpp's ``llama-vocab.cpp`` (pre-tokenizer regexes per ``tokenizer.ggml.pre``, which tokens
are matched whole in text, when a BOS is added) rather than the original Hugging Face repository.
Errors are ``ValueError`` with a one-line reason; the caller adds the file name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Token texts llama.cpp treats as end-of-generation, and forces to control type, whatever the file
# says (llama-vocab.cpp, load()).
EOG_TOKEN_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
     "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
     "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
     "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["]
)  # fmt: skip

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _pre(names: str, splits: list[str], ignore_merges: bool = False, add_bos: bool = False) -> dict:
    return {name: (splits, ignore_merges, add_bos) for name in names.split()}


# tokenizer.ggml.pre -> (regexes applied in turn, BPE ignore_merges, default add_bos), as
# llama-vocab.cpp sets them. A name missing here is refused rather than tokenized differently.
_BPE_PRE = {
    **_pre("default", _DEFAULT),
    **_pre("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", [_LLAMA3], True, True),
    **_pre("dbrx smaug-bpe", [_LLAMA3]),
    **_pre("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", [_QWEN2]),
    **_pre("qwen35", [_QWEN35]),
    **_pre("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", [r"\p{N}", _GPT2]),
    **_pre("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 mellum gigachat a.x-4.0", [_GPT2]),
    **_pre("tekken", [_TEKKEN], True, True),
    **_pre("gpt-4o llama4 kanana2", [_GPT4O]),
}


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges that reproduce llama.cpp's score-driven SentencePiece merging: every split of a token
    into two vocabulary pieces, best-scored result first."""
    ids = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((-score, ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def _bpe(meta: Mapping[str, Any], tokens: list[str]) -> tuple[models.Model, Any, Any, Any]:
    """(model, pre-tokenizer, normalizer, decoder) of a byte-level BPE vocabulary ("gpt2")."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _BPE_PRE:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported by the MLX engine; use the llama engine")
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError("byte-level BPE vocabulary without tokenizer.ggml.merges")
    splits, ignore_merges, _ = _BPE_PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges, fuse_unk=False
    )
    pre_tok = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return model, pre_tok, None, decoders.ByteLevel()


def _spm(meta: Mapping[str, Any], tokens: list[str]) -> tuple[models.Model, Any, Any, Any]:
    """(model, pre-tokenizer, normalizer, decoder) of a SentencePiece vocabulary ("llama")."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("SentencePiece vocabulary without tokenizer.ggml.scores")
    unk_id = _token_id(meta, "unknown")
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=_spm_merges(tokens, scores),
        unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None,
        byte_fallback=True,
        fuse_unk=True,
    )
    steps = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp puts a space before every run of text that starts the input or follows a
        # special token; a normalizer runs once per such run, so Prepend does the same.
        steps.insert(0, normalizers.Prepend("▁"))
        decode.append(decoders.Strip(" ", 1, 0))
    return model, None, normalizers.Sequence(steps), decoders.Sequence(decode)


def _token_id(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def eos_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """Every id llama.cpp stops generating on: eos, eot, eom and the end-of-turn-looking tokens."""
    tokens = meta["tokenizer.ggml.tokens"]
    ids = [_token_id(meta, key) for key in ("eos", "eot", "eom")]
    ids += [i for i, t in enumerate(tokens) if t in EOG_TOKEN_TEXTS]
    return list(dict.fromkeys(i for i in ids if i is not None and 0 <= i < len(tokens)))


def build_tokenizer(meta: Mapping[str, Any], context_length: int | None = None) -> tuple[str, dict]:
    """``(tokenizer.json text, tokenizer_config.json content)`` from GGUF metadata values."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("no tokenizer.ggml.tokens in the metadata")
    tokens = list(tokens)
    if kind == "gpt2":
        model, pre_tok, normalizer, decoder = _bpe(meta, tokens)
        add_bos_default = _BPE_PRE[meta.get("tokenizer.ggml.pre", "default")][2]
    elif kind == "llama":
        model, pre_tok, normalizer, decoder = _spm(meta, tokens)
        add_bos_default = True
    else:
        raise ValueError(f"tokenizer model {kind!r} is not supported by the MLX engine; use the llama engine")

    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tok
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoder

    # llama.cpp matches control, unknown and user-defined tokens whole before tokenizing the rest;
    # added tokens do the same. Control/unknown ones (and EOG look-alikes) are special.
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    added = []
    for token_id, token_type in enumerate(types):
        text = tokens[token_id]
        special = token_type in (_CONTROL, _UNKNOWN) or text in EOG_TOKEN_TEXTS
        if (special or token_type == _USER_DEFINED) and text:
            added.append(AddedToken(text, special=special, normalized=False))
    tokenizer.add_tokens(added)

    def text_of(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos_id, eos_id = _token_id(meta, "bos"), _token_id(meta, "eos")
    bos, eos = text_of(bos_id), text_of(eos_id)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        before, after = [bos] if add_bos else [], [eos] if add_eos else []
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*before, "$A", *after],
            pair=[*before, "$A", *after, *(f"{t}:1" for t in before), "$B:1", *(f"{t}:1" for t in after)],
            special_tokens=[(bos, bos_id)] * add_bos + [(eos, eos_id)] * add_eos,
        )

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": text_of(_token_id(meta, "unknown")),
        "pad_token": text_of(_token_id(meta, "padding")),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer.to_str(), {k: v for k, v in config.items() if v is not None}
