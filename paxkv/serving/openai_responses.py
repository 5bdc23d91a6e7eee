"""The OpenAI API's response bodies built from RequestOutputs: whole responses, stream chunks, logprobs in the
completions and the chat formats, and usage."""

import time
import uuid

from paxkv.core.outputs import CompletionOutput, Logprob, RequestOutput


def response_id(prefix: str) -> str:
    """A fresh id such as cmpl-3f2a... or chatcmpl-3f2a..."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage: prompt tokens (once per prompt) and generated tokens (over every choice)."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The entry's num_top most likely tokens, most likely first (the sampled token's own entry may rank lower)."""
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)[:num_top]


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, text_offset: int
) -> dict:
    """The completions endpoint's logprobs: tokens, token_logprobs, top_logprobs and text_offset, per token.

    Args:
      token_ids: the tokens, in order.
      entries: their CompletionOutput.logprobs entries.
      num_top: top log-probabilities per token.
      text_offset: where the first token's text starts in the choice's text.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> dict:
    """The chat endpoint's logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in _top(entry, num_top)]})
    return {"content": content}


class ChoiceStream:
    """What a stream has sent of one choice: its text, held back where it could still turn into a stop string (which
    would be cut off), and its tokens."""

    def __init__(self, stops: tuple[str, ...]):
        """Args:
        stops: the request's stop strings.
        """
        self.holdback = max((len(stop) for stop in stops), default=1) - 1
        self.num_chars = 0
        self.num_tokens = 0

    def advance(self, completion: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        """(new text, new token ids, their logprob entries) since the last call; everything once it has finished."""
        text = completion.text
        finished = completion.finish_reason is not None
        ready = len(text) if finished else max(self.num_chars, len(text) - self.holdback)
        new_text = text[self.num_chars : ready]
        new_tokens = completion.token_ids[self.num_tokens :]
        entries = (completion.logprobs or [])[self.num_tokens :]
        self.num_chars, self.num_tokens = ready, len(completion.token_ids)
        return new_text, new_tokens, entries


def completion_response(
    request_id: str, model: str, outputs: list[RequestOutput], num_logprobs: int | None, created: int | None = None
) -> dict:
    """The whole /v1/completions response: a choice per (prompt, sample), index prompt * n + sample."""
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in output.outputs:
            logprobs = None
            if num_logprobs is not None:
                logprobs = completion_logprobs(completion.token_ids, completion.logprobs, num_logprobs, 0)
            choices.append(
                {
                    "index": prompt_index * len(output.outputs) + completion.index,
                    "text": completion.text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
            )
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def chat_response(
    request_id: str, model: str, output: RequestOutput, num_logprobs: int | None, created: int | None = None
) -> dict:
    """The whole /v1/chat/completions response: a choice per sample."""
    choices = []
    for completion in output.outputs:
        logprobs = None
        if num_logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, num_logprobs)
        choices.append(
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([output]),
    }
