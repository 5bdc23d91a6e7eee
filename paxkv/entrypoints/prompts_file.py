"""JSONL prompt files for the runner: parse and validate each line, write results back one object per line."""

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from paxkv.entrypoints.output_files import request_hash
from paxkv.scheduling.sampling_params import SamplingParams

# Keys a line may carry besides the sampling fields.
PROMPT_KEYS = ("prompt", "messages")
OTHER_KEYS = ("id", "cache_salt")


@dataclasses.dataclass(frozen=True)
class PromptLine:
    """One valid line: an id, a prompt (text, token ids or chat messages) and its sampling params."""

    line_number: int  # 1-based, as editors count
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    sampling_params: SamplingParams
    cache_salt: str | None = None

    @property
    def input_hash(self) -> str:
        """A hash of everything that decides this line's output, so --resume can tell an edited line."""
        fields = dataclasses.asdict(self.sampling_params)
        return request_hash(self.prompt, self.messages, self.cache_salt, fields)


@dataclasses.dataclass(frozen=True)
class BadLine:
    """A line that cannot run, and why."""

    line_number: int
    request_id: str
    error: str


def _check_messages(messages: Any) -> list[dict]:
    """A chat conversation: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f'"messages"[{index}] must be an object with a string "role"')
        if not isinstance(message.get("content"), str):
            raise ValueError(f'"messages"[{index}] must have a string "content"')
    return [dict(message) for message in messages]


def _check_prompt(prompt: Any) -> str | list[int]:
    """A prompt: a string or a list of integer token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError('"prompt" must be a string or a list of integer token ids')


def parse_line(text: str, line_number: int, defaults: Mapping[str, Any]) -> PromptLine:
    """Parse one JSONL line, or raise ValueError naming the problem.

    Args:
      text: the line, without its newline.
      line_number: its 1-based number, used for the default id.
      defaults: sampling fields from the command line; the line's own fields override them.
    """
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a line must be a JSON object, got {type(record).__name__}")
    sampling_fields = set(SamplingParams.field_names())
    unknown = sorted(set(record) - sampling_fields - set(PROMPT_KEYS) - set(OTHER_KEYS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown}; a line holds {list(PROMPT_KEYS)} (one of them), optional 'id' and "
            "'cache_salt', "
            f"and sampling fields {sorted(sampling_fields)}"
        )
    given = [key for key in PROMPT_KEYS if key in record]
    if len(given) != 1:
        raise ValueError('a line needs exactly one of "prompt" or "messages"')
    request_id = str(record.get("id", f"line-{line_number}"))
    prompt = _check_prompt(record["prompt"]) if "prompt" in record else None
    messages = _check_messages(record["messages"]) if "messages" in record else None
    cache_salt = record.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError('"cache_salt" must be a string')
    params = {**defaults, **{key: value for key, value in record.items() if key in sampling_fields}}
    return PromptLine(line_number, request_id, prompt, messages, SamplingParams.from_dict(params), cache_salt)


def parse_lines(lines: Iterable[str], defaults: Mapping[str, Any], source: str) -> list[PromptLine | BadLine]:
    """Parse every non-blank line; bad ones become BadLine with `source:line:` in the error.

    Args:
      lines: the file's lines.
      defaults: sampling fields from the command line.
      source: the file name, for messages.
    """
    parsed: list[PromptLine | BadLine] = []
    seen_ids: set[str] = set()
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            _check_utf8(text)
            line = parse_line(text, line_number, defaults)
        except ValueError as e:
            parsed.append(BadLine(line_number, _id_of(text, line_number), f"{source}:{line_number}: {e}"))
            continue
        if line.request_id in seen_ids:  # the record keeps line-N: the id belongs to the earlier line
            error = f"{source}:{line_number}: id {line.request_id!r} appears twice; give each line a unique id"
            parsed.append(BadLine(line_number, f"line-{line_number}", error))
            continue
        seen_ids.add(line.request_id)
        parsed.append(line)
    return parsed


def decode_file(data: bytes) -> str:
    """A prompts file's text: UTF-8 without a leading BOM; bytes that are not UTF-8 stay as surrogate escapes, so
    parse_lines rejects their lines alone (with line numbers) instead of the whole file."""
    return data.removeprefix(b"\xef\xbb\xbf").decode("utf-8", errors="surrogateescape")


def _check_utf8(text: str) -> None:
    """Raise ValueError at the first byte decode_file could not decode."""
    for column, char in enumerate(text, start=1):
        if "\udc80" <= char <= "\udcff":
            raise ValueError(
                f"not UTF-8 text (byte 0x{ord(char) - 0xDC00:02x} at column {column}); save the file as UTF-8"
            )


def _id_of(text: str, line_number: int) -> str:
    """The "id" a bad line gives, when it is a JSON object with one; else line-N."""
    try:
        record = json.loads(text)
    except ValueError:
        return f"line-{line_number}"
    if isinstance(record, dict) and isinstance(record.get("id"), (str, int)) and not isinstance(record["id"], bool):
        return str(record["id"])
    return f"line-{line_number}"


def result_record(
    line_number: int | None,
    request_id: str,
    output=None,
    error: str | None = None,
    input_hash: str | None = None,
) -> dict:
    """One output JSONL object: the request's completion and metrics, or its error.

    Args:
      line_number: the input line, when the prompt came from a file.
      request_id: the request's id.
      output: its finished (or aborted) RequestOutput, when it ran.
      error: why it did not run, when it did not.
      input_hash: PromptLine.input_hash of the line, which --resume compares.
    """
    record: dict[str, Any] = {"id": request_id}
    if line_number is not None:
        record["line"] = line_number
    if input_hash is not None:
        record["input_hash"] = input_hash
    if error is not None:
        record["error"] = error
        return record
    completion = output.outputs[0]
    record.update(
        prompt=output.prompt,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_generated_tokens=len(completion.token_ids),
        metrics=output.metrics.as_dict(),
    )
    if len(output.outputs) > 1:  # n > 1: every sample; the top-level fields repeat sample 0's
        record["completions"] = [
            {
                "index": sample.index,
                "text": sample.text,
                "token_ids": sample.token_ids,
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }
            for sample in output.outputs
        ]
    if completion.logprobs is not None:
        record["cumulative_logprob"] = completion.cumulative_logprob
        record["logprobs"] = [
            [
                {"token_id": token_id, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                for token_id, lp in entry.items()
            ]
            for entry in completion.logprobs
        ]
    return record
