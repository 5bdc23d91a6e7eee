"""Tokenizer: text <-> token ids, special tokens, chat templates and streaming detokenization."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping

import tokenizers
from tokenizers.decoders import DecodeStream

from models import gguf_tokenizer
from models.chat_template import render_chat_template
from models.errors import CheckpointError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids, special tokens, chat template and incremental detokenization."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ):
        """Wrap a `tokenizers.Tokenizer` with the special tokens and chat template of its model.

        Args:
            backend: the `tokenizers` tokenizer; its post-processor decides which special tokens encode adds.
            bos_token: text of the beginning-of-sequence token, if the model has one.
            eos_token: text of the end-of-sequence token, if the model has one.
            pad_token: text of the padding token, if any.
            unk_token: text of the unknown token, if any.
            chat_template: Jinja2 chat template, if the model has one.
            add_bos_token: prepend BOS in encode when the backend's post-processor does not already.
            add_eos_token: append EOS in encode when the backend's post-processor does not already.
        """
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        # What the post-processor adds shows on the empty text: only special tokens are left.
        added = backend.encode("", add_special_tokens=True).ids
        self._processor_adds_bos = self.bos_token_id is not None and added[:1] == [self.bos_token_id]
        self._processor_adds_eos = self.eos_token_id is not None and added[-1:] == [self.eos_token_id]

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from a Hugging Face model folder.

        Args:
            path: the folder holding tokenizer.json (required) and, optionally, tokenizer_config.json,
                special_tokens_map.json, chat_template.jinja or chat_template.json.
        """
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(tokenizer_file):
            raise CheckpointError(
                f"{tokenizer_file} not found: paxkv needs the fast-tokenizer file {TOKENIZER_FILE}. Copy it from the "
                "model repository, or write it with transformers: "
                f"AutoTokenizer.from_pretrained(...).save_pretrained({path!r})."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as error:
            raise CheckpointError(
                f"{tokenizer_file} cannot be parsed ({error}); replace it with the model's original {TOKENIZER_FILE} "
                "or re-save it with a current transformers/tokenizers."
            ) from error
        # encode must return every id: a saved truncation or padding setting does not belong to the model.
        backend.no_truncation()
        backend.no_padding()

        config = _read_json(os.path.join(path, TOKENIZER_CONFIG_FILE))
        special_map = _read_json(os.path.join(path, SPECIAL_TOKENS_MAP_FILE))
        special = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = config.get(name, special_map.get(name))
            special[name] = _token_content(value, name, path)
        return cls(
            backend,
            chat_template=_read_chat_template(path, config),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            **special,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> Tokenizer:
        """Build the tokenizer embedded in a GGUF file.

        Args:
            metadata: GGUF keys mapped to plain Python values, i.e.
                `{key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}`.
        """
        backend = gguf_tokenizer.tokenizer_from_gguf(metadata)
        add_bos, add_eos = gguf_tokenizer.add_special_flags(metadata)
        chat_template = metadata.get("tokenizer.chat_template")
        return cls(
            backend,
            bos_token=gguf_tokenizer.special_token(metadata, "bos_token"),
            eos_token=gguf_tokenizer.special_token(metadata, "eos_token"),
            pad_token=gguf_tokenizer.special_token(metadata, "pad_token"),
            unk_token=gguf_tokenizer.special_token(metadata, "unk_token"),
            chat_template=str(chat_template) if chat_template is not None else None,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
        )

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None."""
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the EOS token, or None."""
        return self._token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self._token_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        """Id of the unknown token, or None."""
        return self._token_id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str | None) -> int | None:
        """Return the id of `token`, or None when it is None or not in the vocabulary."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Turn text into token ids; special tokens written in the text map to their ids.

        Args:
            text: the text to encode.
            add_special_tokens: add BOS/EOS as the backend's post-processor does (and BOS/EOS per
                add_bos_token/add_eos_token when the post-processor does not add them).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text holds {text[e.start]!r} at character {e.start}, a lone surrogate that UTF-8 cannot "
                "encode; fix the text (e.g. read it with errors='replace')"
            ) from None
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and not self._processor_adds_bos and ids[:1] != [bos]:
                ids = [bos, *ids]
            if self.add_eos_token and eos is not None and not self._processor_adds_eos and ids[-1:] != [eos]:
                ids = [*ids, eos]
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text.

        Args:
            token_ids: the ids (any iterable of ints, e.g. a list or a 1-D array).
            skip_special_tokens: leave special tokens (BOS, EOS, <|im_start|>, ...) out of the text.
        """
        return self.backend.decode([int(token_id) for token_id in token_ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template, as transformers does.

        Args:
            messages: the conversation, a list of {"role": str, "content": str, ...} dicts.
            add_generation_prompt: end with the header that starts the assistant's reply.
            tokenize: return token ids (special tokens in the rendered text map to their ids; no BOS/EOS added).
            **kwargs: more template variables (e.g. tools, documents, enable_thinking); they override the
                special-token variables bos_token, eos_token, unk_token and pad_token.
        """
        if self.chat_template is None:
            raise ValueError(
                "This tokenizer has no chat template; pass a prompt string instead, or load a checkpoint whose "
                f"tokenizer carries one ({CHAT_TEMPLATE_FILE}, tokenizer_config.json 'chat_template', or the GGUF "
                "key tokenizer.chat_template)."
            )
        variables = {"tools": None, "documents": None}
        for name in _SPECIAL_TOKEN_NAMES:
            value = getattr(self, name)
            if value is not None:
                variables[name] = value
        variables.update(kwargs)
        text = render_chat_template(self.chat_template, messages, add_generation_prompt, variables)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def save(self, directory: str) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (readable by from_hf_dir).

        Args:
            directory: an existing folder.
        """
        self.backend.save(os.path.join(directory, TOKENIZER_FILE))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
        }
        with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
        if self.chat_template is not None:
            with open(os.path.join(directory, CHAT_TEMPLATE_FILE), "w") as f:
                f.write(self.chat_template)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """Start a streaming detokenizer over this tokenizer.

        Args:
            skip_special_tokens: leave special tokens out of the streamed text, as decode does.
        """
        return IncrementalDetokenizer(self.backend, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, correct across multi-byte UTF-8 characters."""

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        """Start an empty stream.

        Args:
            backend: the `tokenizers` tokenizer whose decoder turns ids into text.
            skip_special_tokens: leave special tokens out of the text.
        """
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0

    def step(self, token_id: int) -> str:
        """Feed one token id and return the text it completes ('' while a multi-byte character is incomplete).

        Args:
            token_id: the next generated token id.
        """
        token_id = int(token_id)
        self._ids.append(token_id)
        delta = self._stream.step(self._backend, token_id) or ""
        self._emitted += len(delta)
        return delta

    def flush(self) -> str:
        """Return the text still held back at the end of the stream (an unfinished character decodes as U+FFFD)."""
        text = self._backend.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        rest = text[self._emitted :]
        self._emitted = len(text)
        return rest


def _read_json(file_path: str) -> dict:
    """Return the JSON object in `file_path`, or {} when the file does not exist."""
    if not os.path.isfile(file_path):
        return {}
    try:
        with open(file_path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{file_path} cannot be read as JSON ({error}); replace it with the model's original file."
        ) from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{file_path} must hold a JSON object; replace it with the model's original file.")
    return data


def _token_content(value, name: str, path: str) -> str | None:
    """Return a special token's text from its tokenizer_config.json form: a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(
        f"{os.path.join(path, TOKENIZER_CONFIG_FILE)}: {name} must be a string or a dict with a 'content' string, "
        f"got {value!r}; fix the file."
    )


def _read_chat_template(path: str, config: Mapping) -> str | None:
    """Return the folder's chat template: chat_template.jinja, else chat_template.json, else tokenizer_config.json."""
    jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as handle:
            return handle.read()
    template = _read_json(os.path.join(path, CHAT_TEMPLATE_JSON_FILE)).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        logger.warning(
            "%s: none of the chat templates %s is named 'default'; using none", path, sorted(map(str, named))
        )
        return None
    raise CheckpointError(
        f"{os.path.join(path, TOKENIZER_CONFIG_FILE)}: chat_template must be a string or a list of "
        "{'name', 'template'} dicts; fix the file or add a chat_template.jinja."
    )
