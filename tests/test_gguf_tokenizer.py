"""The SentencePiece-style (llama) GGUF tokenizer: against SentencePiece's own ids and transformers."""

import os

import gguf
import numpy as np
import pytest

from models.errors import CheckpointError
from models.gguf_tokenizer import sentencepiece_merges
from models.tokenizer import Tokenizer


def _read_metadata(path: str) -> dict:
    """Read a GGUF file's metadata as plain Python values."""
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


# A small SentencePiece BPE vocabulary with byte fallback, laid out like Llama's: <unk>, <s>, </s>, one user-defined
# token, the 256 <0xNN> byte tokens, then the learned pieces. The pieces are those sentencepiece 0.2.3 learned
# (model_type=bpe, byte_fallback, add_dummy_prefix, identity normalization) on a few English sentences: the merges
# best first, then the single characters; a piece's score is minus its position here, as in SentencePiece.
SPM_PIECES = [
    "▁t",
    "he",
    "▁the",
    "▁s",
    "or",
    "▁i",
    "ll",
    "▁se",
    "en",
    "ok",
    "re",
    "▁o",
    "▁w",
    "▁is",
    "hell",
    "oken",
    "▁there",
    "▁token",
    "er",
    "ex",
    "hi",
    "ld",
    "ng",
    "nt",
    "um",
    "▁n",
    "ext",
    "nto",
    "hing",
    "orld",
    "▁sea",
    "hello",
    "▁into",
    "▁text",
    "▁hello",
    "▁world",
    "▁tokens",
    "af",
    "an",
    "▁",
    "e",
    "t",
    "o",
    "h",
    "s",
    "n",
    "r",
    "l",
    "i",
    "a",
    "d",
    "k",
    "u",
    "w",
    "f",
    "g",
    "x",
    "é",
    ",",
    "c",
    "m",
    "v",
    "y",
    "z",
    "b",
    "j",
    "p",
    "q",
    "ï",
    "ñ",
]


SPM_HEAD = ["<unk>", "<s>", "</s>", "<tool>"]


SPM_HEAD_TYPES = [2, 3, 3, 4]  # unknown, control, control, user-defined


# Ids sentencepiece 0.2.3 itself gives on the model these pieces come from (encode, no BOS).
SPM_REFERENCE_IDS = [
    ("hello world", [294, 295]),
    ("the theory of the thing", [262, 262, 264, 322, 271, 314, 262, 260, 288]),
    (" leading space", [299, 299, 307, 300, 309, 310, 308, 282, 263, 326, 309, 319, 300]),
    ("two  spaces", [260, 313, 302, 299, 263, 326, 309, 319, 300, 304]),
    ("trailing ", [260, 306, 309, 308, 307, 308, 282, 299]),
    ("café señor", [299, 319, 297, 317, 267, 329, 264]),
    ("你好 😀", [299, 232, 193, 164, 233, 169, 193, 299, 244, 163, 156, 132]),
    ("123 thee", [299, 53, 54, 55, 262, 300]),
    ("Hello", [299, 76, 300, 266, 302]),
    ("sea\tshells\n", [290, 13, 304, 274, 304, 14]),
    ("", []),
]


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """The test SentencePiece vocabulary: tokens, scores and llama.cpp token types."""
    tokens = SPM_HEAD + [f"<0x{byte:02X}>" for byte in range(256)] + SPM_PIECES
    scores = [0.0] * (len(SPM_HEAD) + 256) + [-float(index) for index in range(len(SPM_PIECES))]
    types = SPM_HEAD_TYPES + [6] * 256 + [1] * len(SPM_PIECES)
    return tokens, scores, types


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> str:
    """A tiny llama-architecture GGUF whose tokenizer is the SentencePiece vocabulary above."""
    tokens, scores, types = _spm_vocab()
    path = str(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_metadata(spm_gguf) -> dict:
    """Metadata of the tiny SentencePiece GGUF."""
    return _read_metadata(spm_gguf)


@pytest.fixture(scope="module")
def spm(spm_metadata) -> Tokenizer:
    """Our tokenizer for the tiny SentencePiece GGUF."""
    return Tokenizer.from_gguf_metadata(spm_metadata)


@pytest.fixture(scope="module")
def hf_spm(spm_gguf):
    """Transformers' tokenizer for the tiny SentencePiece GGUF."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(spm_gguf), gguf_file=os.path.basename(spm_gguf))


@pytest.mark.parametrize(("text", "expected"), SPM_REFERENCE_IDS)
def test_sentencepiece_gguf_matches_sentencepiece(spm, text, expected):
    assert spm.encode(text, add_special_tokens=False) == expected
    assert spm.encode(text) == [1, *expected]  # add_bos_token defaults on for llama vocabularies
    assert spm.decode(spm.encode(text)) == text


@pytest.mark.parametrize("text", [s for s, _ in SPM_REFERENCE_IDS if not s.startswith(" ")] + ["hello<tool>"])
def test_sentencepiece_gguf_matches_transformers(spm, hf_spm, text):
    assert spm.encode(text) == hf_spm.encode(text)
    assert spm.decode(spm.encode(text)) == hf_spm.decode(hf_spm.encode(text), skip_special_tokens=True)


def test_sentencepiece_gguf_hand_checked(spm):
    tokens, _, _ = _spm_vocab()
    # "▁the" is a piece, so " the" after the dummy prefix is one token; "H" is not, so it falls back to byte 0x48.
    assert spm.encode("the") == [1, tokens.index("▁the")]
    assert spm.encode("Hi", add_special_tokens=False) == [tokens.index("▁"), tokens.index("<0x48>"), tokens.index("i")]
    # Like llama.cpp (and Meta's reference code, which encodes the text between special tokens one piece at a time),
    # text after a special or user-defined token gets the "▁" prefix again. transformers' GGUF loader (Metaspace,
    # prepend_scheme="first") and SentencePiece (which does not split there) do not add it.
    assert spm.encode("x<tool>y", add_special_tokens=False) == [
        tokens.index("▁"),
        tokens.index("x"),
        tokens.index("<tool>"),
        tokens.index("▁"),
        tokens.index("y"),
    ]
    assert spm.encode("<s>the", add_special_tokens=False) == [1, tokens.index("▁the")]
    assert spm.decode(spm.encode("x<tool>y"), skip_special_tokens=True) == "x<tool> y"
    assert spm.unk_token == "<unk>" and spm.bos_token == "<s>" and spm.eos_token == "</s>"


def test_sentencepiece_gguf_flags(spm_metadata):
    tokens, _, _ = _spm_vocab()
    no_bos = Tokenizer.from_gguf_metadata({**spm_metadata, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("the") == [tokens.index("▁the")]
    with_eos = Tokenizer.from_gguf_metadata({**spm_metadata, "tokenizer.ggml.add_eos_token": True})
    assert with_eos.encode("the") == [1, tokens.index("▁the"), 2]
    no_prefix = Tokenizer.from_gguf_metadata({**spm_metadata, "tokenizer.ggml.add_space_prefix": False})
    assert no_prefix.encode("the the", add_special_tokens=False) == [tokens.index(p) for p in ("t", "he", "▁the")]
    assert no_prefix.decode(no_prefix.encode(" the the")) == " the the"


def test_sentencepiece_merges_follow_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    merges = sentencepiece_merges(tokens, scores, [True] * len(tokens))
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
    assert sentencepiece_merges(tokens, scores, [True, True, True, True, False, True]) == [
        ("a", "b"),
        ("ab", "c"),
    ]


def test_detokenizer_byte_fallback_sentencepiece(spm):
    text = "café 你好 😀 the world"
    ids = spm.encode(text)
    stream = spm.detokenizer()
    deltas = [stream.step(token_id) for token_id in ids]
    assert "".join(deltas) == spm.decode(ids) == text
    assert deltas.count("") >= 5  # <s> and the leading bytes of 你, 好 and 😀
    assert all("\ufffd" not in delta for delta in deltas)


def test_unsupported_gguf_tokenizer_model(spm_metadata):
    with pytest.raises(CheckpointError, match=r"'bert' is not supported.*'gpt2', 'llama'"):
        Tokenizer.from_gguf_metadata({**spm_metadata, "tokenizer.ggml.model": "bert"})


def test_no_chat_template(spm):
    assert spm.chat_template is None
    with pytest.raises(ValueError, match="has no chat template; pass a prompt string instead"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])
