"""Build a `tokenizers.Tokenizer` from the tokenizer metadata stored in a GGUF file."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from models.errors import CheckpointError

logger = logging.getLogger(__name__)

# llama.cpp's token types (`tokenizer.ggml.token_type`).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SUPPORTED_MODELS = ("gpt2", "llama")

# The GGUF keys naming the special tokens, by the name the tokenizer gives them.
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

SPIECE_SPACE = "\u2581"

# Pre-tokenizer regexes of byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre`. Each is the `Split` regex of
# the original Hugging Face `tokenizer.json`; the text is split with it, then spelled in bytes by
# `ByteLevel(use_regex=False)`.
#   llama3, llama-v3, llama-bpe, falcon3, dbrx, smaug-bpe  -> _LLAMA3_REGEX (Llama 3; numbers in runs of 1-3 digits)
#   qwen2, deepseek-r1-qwen, megrez                         -> _QWEN2_REGEX (as Llama 3, but one digit per piece)
#   gpt-4o, llama4                                          -> _GPT4O_REGEX (OpenAI o200k; case-aware words)
#   tekken                                                  -> _TEKKEN_REGEX (Mistral Tekken)
# `_GPT2_PRE_TYPES` (default, gpt-2, smollm, ...) keep GPT-2's own regex, built into `ByteLevel(use_regex=True)`;
# so does any unknown pre type, with a warning. llama.cpp splits digits one by one before GPT-2's regex for smollm,
# starcoder and refact; the vocabularies of those models have no multi-digit tokens and no digit merges, so this only
# shows where whitespace runs end right before a digit, and we follow transformers' GGUF loader there.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES = {
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "falcon3": _LLAMA3_REGEX,
    "dbrx": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
    "megrez": _QWEN2_REGEX,
    "gpt-4o": _GPT4O_REGEX,
    "llama4": _GPT4O_REGEX,
    "tekken": _TEKKEN_REGEX,
}
_GPT2_PRE_TYPES = frozenset({"default", "gpt-2", "gpt2", "smollm", "starcoder", "refact", "olmo"})
# Pre types whose original tokenizer looks a whole pre-token up in the vocabulary before merging
# (`"ignore_merges": true` in Llama 3's tokenizer.json) and that llama.cpp starts with BOS unless the file says not to.
_IGNORE_MERGES_PRE_TYPES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"})


def tokenizer_from_gguf(metadata: Mapping) -> tokenizers.Tokenizer:
    """Build the tokenizer a GGUF file describes, with its special tokens and BOS/EOS post-processing.

    Args:
        metadata: GGUF keys mapped to plain Python values, as `field.contents()` returns them.
    """
    model_type = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model_type is None or not tokens:
        raise CheckpointError(
            "GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens are missing); "
            "convert the model with llama.cpp's convert_hf_to_gguf.py, which embeds the tokenizer, "
            "or load the tokenizer from a Hugging Face folder instead."
        )
    tokens = [str(token) for token in tokens]
    token_types = _token_types(metadata, len(tokens))
    if model_type == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, token_types)
    elif model_type == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, token_types)
    else:
        raise CheckpointError(
            f"GGUF tokenizer model {model_type!r} is not supported; supported tokenizer.ggml.model values are "
            f"{', '.join(repr(name) for name in SUPPORTED_MODELS)}. Load the tokenizer from the model's "
            "Hugging Face folder (tokenizer.json) instead."
        )
    _add_special_tokens(backend, metadata, tokens, token_types)
    add_bos, add_eos = add_special_flags(metadata)
    backend.post_processor = _bos_eos_processor(
        special_token(metadata, "bos_token") if add_bos else None,
        special_token(metadata, "eos_token") if add_eos else None,
        backend,
    )
    return backend


def special_token(metadata: Mapping, name: str) -> str | None:
    """Return the text of the special token `name` (e.g. "bos_token"), or None when the file names none.

    Args:
        metadata: GGUF keys mapped to plain Python values.
        name: one of "bos_token", "eos_token", "unk_token", "pad_token".
    """
    token_id = metadata.get(SPECIAL_TOKEN_KEYS[name])
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return str(tokens[int(token_id)])


def add_special_flags(metadata: Mapping) -> tuple[bool, bool]:
    """Return (add_bos_token, add_eos_token); where the file does not say, BOS defaults as in llama.cpp.

    Args:
        metadata: GGUF keys mapped to plain Python values.
    """
    bos_by_default = metadata.get("tokenizer.ggml.model") == "llama" or (
        metadata.get("tokenizer.ggml.model") == "gpt2"
        and metadata.get("tokenizer.ggml.pre") in _IGNORE_MERGES_PRE_TYPES
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", bos_by_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    return add_bos, add_eos


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]) -> list:
    """Derive BPE merges from a SentencePiece vocabulary, best first, so that BPE merges as SentencePiece would.

    Args:
        tokens: the vocabulary, indexed by token id.
        scores: the score of each token.
        mergeable: whether each token takes part in merges (normal pieces do; control, byte, unused and
            user-defined tokens do not).
    """
    # SentencePiece BPE repeatedly joins the adjacent pair whose joined piece scores highest. So every cut of a
    # piece into two pieces of the vocabulary is a merge, ranked by the joined piece's score (higher first), then
    # by its id, then by where it is cut.
    ids = {}
    for token_id, (token, usable) in enumerate(zip(tokens, mergeable, strict=False)):
        if usable:
            ids.setdefault(token, token_id)
    ranked = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[token_id]), token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _token_types(metadata: Mapping, count: int) -> list[int]:
    """Return the llama.cpp type of each token, NORMAL where the file gives none."""
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [TOKEN_NORMAL] * count
    if len(token_types) != count:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries but tokenizer.ggml.tokens has {count}; "
            "the file is corrupt, re-convert it."
        )
    return [int(token_type) for token_type in token_types]


def _byte_level_bpe(metadata: Mapping, tokens: list[str], token_types: list[int]) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 style): tokens are spelled in the 256-character byte alphabet."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise CheckpointError(
            "GGUF byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2') has no tokenizer.ggml.merges; "
            "the file is incomplete, re-convert it with llama.cpp's convert_hf_to_gguf.py."
        )
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    speller = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        if token_type in (TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_BYTE) and not set(token) <= alphabet:
            # Some converters store a normal token as raw text; the model looks it up by its byte spelling.
            token = "".join(piece for piece, _ in speller.pre_tokenize_str(token))
        vocab.setdefault(token, token_id)
    pairs = [_split_merge(merge) for merge in merges]
    pre_type = str(metadata.get("tokenizer.ggml.pre", "default"))
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=pre_type in _IGNORE_MERGES_PRE_TYPES,
        )
    )
    regex = PRE_TOKENIZER_REGEXES.get(pre_type)
    if regex is None:
        if pre_type not in _GPT2_PRE_TYPES:
            logger.warning("GGUF pre-tokenizer type %r is unknown; splitting text with GPT-2's regex", pre_type)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge) -> tuple[str, str]:
    """Split a GGUF merge "left right" into its two pieces."""
    left, sep, right = str(merge).partition(" ")
    if not sep or not left or not right:
        raise CheckpointError(f"GGUF tokenizer.ggml.merges has a malformed entry {merge!r}; re-convert the file.")
    return left, right


def _sentencepiece_bpe(metadata: Mapping, tokens: list[str], token_types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE: "▁" marks spaces and unknown characters fall back to <0xNN> byte tokens."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) != len(tokens):
        raise CheckpointError(
            f"GGUF tokenizer.ggml.scores has {len(scores)} entries but tokenizer.ggml.tokens has {len(tokens)}; "
            "the file is corrupt, re-convert it."
        )
    if scores is None:
        # Without scores the vocabulary order is the only ranking left: earlier pieces were learned first.
        scores = [-float(index) for index in range(len(tokens))]
    vocab = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    if metadata.get("tokenizer.ggml.merges") is not None:
        merges = [_split_merge(merge) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        mergeable = [token_type == TOKEN_NORMAL for token_type in token_types]
        merges = sentencepiece_merges(tokens, scores, mergeable)
    unk_token = special_token(metadata, "unk_token")
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(
    backend: tokenizers.Tokenizer, metadata: Mapping, tokens: list[str], token_types: list[int]
) -> None:
    """Register control/unknown tokens (and the named special tokens) as special, user-defined ones as added."""
    special_ids = {
        index for index, token_type in enumerate(token_types) if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    }
    for key in SPECIAL_TOKEN_KEYS.values():
        token_id = metadata.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special_ids.add(int(token_id))
    user_ids = [index for index, token_type in enumerate(token_types) if token_type == TOKEN_USER_DEFINED]
    # Added tokens keep the id of the vocabulary entry with the same text, so they are added in id order and
    # matched in the raw text, before normalization.
    special = [AddedToken(tokens[index], special=True, normalized=False) for index in sorted(special_ids)]
    user_defined = [AddedToken(tokens[index], special=False, normalized=False) for index in user_ids]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def _bos_eos_processor(bos_token: str | None, eos_token: str | None, backend: tokenizers.Tokenizer):
    """Return a post-processor that adds BOS/EOS around each sequence, or None when neither is added."""
    if bos_token is None and eos_token is None:
        return None
    bos = [bos_token] if bos_token is not None else []
    eos = [eos_token] if eos_token is not None else []

    def sequence(name, type_id):
        specials = [{"SpecialToken": {"id": token, "type_id": type_id}} for token in bos]
        specials.append({"Sequence": {"id": name, "type_id": type_id}})
        return specials + [{"SpecialToken": {"id": token, "type_id": type_id}} for token in eos]

    processor = {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": {
            token: {"id": token, "ids": [backend.token_to_id(token)], "tokens": [token]} for token in bos + eos
        },
    }
    # Built from its JSON form, because the string form of a template cannot name a token containing ":" or " ".
    holder = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": processor,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {}, "unk_token": "<unk>"},
    }
    return tokenizers.Tokenizer.from_str(json.dumps(holder)).post_processor
