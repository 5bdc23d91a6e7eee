"""The OpenAI API's request bodies, as vLLM serves them: the OpenAI fields, vLLM's extra sampling fields at the top
level, unknown fields ignored (as OpenAI does); the SamplingParams a request makes; OpenAI-shaped errors."""

import http
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from paxkv.scheduling.sampling_params import SamplingParams


class APIError(Exception):
    """An error the server answers with an OpenAI-shaped JSON body and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None):
        """Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        param: the request field at fault, if one is.
        code: a machine-readable code (OpenAI's, where it has one).
        headers: extra response headers (Retry-After).
        """
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


# OpenAI's error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error body."""
    kind = _ERROR_TYPES.get(status, http.HTTPStatus(status).phrase.lower().replace(" ", "_"))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    """stream_options: include_usage adds a last chunk with the usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share: the OpenAI sampling fields and vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    priority: int = 0

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams; a ValueError names a bad value.

        Args:
          num_prompt_tokens: the prompt's length, which sets the default max_tokens (the rest of the context, as
            vLLM's default).
          max_model_len: the engine's context.
          logprobs: top log-probabilities per token, or None.
        """
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, max_model_len - num_prompt_tokens)
        fields: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs=logprobs,
        )
        # Fields the request left out keep SamplingParams' defaults (vLLM's).
        optional = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
        for name in (*optional, "repetition_penalty"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return SamplingParams(**fields)

    def requested_max_tokens(self) -> int | None:
        """The max_tokens the request gave, if any."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt (text or token ids) or a list of prompts."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group: a text, or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(
                400, "prompt is empty; give a string, a list of token ids, or a list of them", param="prompt"
            )
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self, index: int) -> dict:
        """{"role", "content"} for the chat template, the content's text parts joined."""
        content = self.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content if part.type != "text"})
            if kinds:
                raise APIError(
                    400, f"messages[{index}] has {', '.join(kinds)} content; this server takes text only",
                    param="messages",
                )  # fmt: skip
            content = "".join(part.text or "" for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) or else max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per token: top_logprobs when logprobs is true (0 if not given), else None."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or messages to render with the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
