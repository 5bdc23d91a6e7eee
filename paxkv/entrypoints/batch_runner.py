"""Drive an Engine over a list of prompt lines: tokenize, admit all, step to the end, one record per line."""

import functools
import time

from tqdm import tqdm

from paxkv.core.engine import Engine
from paxkv.entrypoints.prompts_file import BadLine, PromptLine, result_record
from paxkv.scheduling.request_checks import integer_token_ids


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens) or a token-id list as is.

    Args:
      tokenizer: the model's tokenizer, or None for weights-only checkpoints.
      prompt: a string or a list of token ids.
    """
    if not isinstance(prompt, str):
        return integer_token_ids(prompt)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; give the prompt as a list of token ids")
    return tokenizer.encode(prompt)


def encode_chat(tokenizer, messages) -> tuple[str, list[int]]:
    """(templated text, token ids) of a conversation, ready for the assistant's turn.

    Args:
      tokenizer: the model's tokenizer; None is an error.
      messages: a list of {"role", "content"} dicts.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template; give token ids instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return text, tokenizer.encode(text, add_special_tokens=False)


def drain(
    engine: Engine, num_requests: int | None = None, *, progress: bool = False, on_step=None, should_stop=None
) -> dict:
    """Step the engine until no request is left (or until asked to stop); return the finished RequestOutputs by id.

    Args:
      engine: the engine to drive.
      num_requests: how many requests will finish (the progress bar's total), if known.
      progress: show a tqdm bar of finished requests on stderr.
      on_step: called after every step with the RequestOutputs it returned, finished or not.
      should_stop: called before every step; when it returns True, drain returns at once and leaves the
        unfinished requests in the engine (the caller aborts them).
    """
    finished = {}
    with tqdm(total=num_requests, disable=not progress, desc="requests", unit="req") as bar:
        while engine.has_unfinished_requests():
            if should_stop is not None and should_stop():
                break
            outputs = engine.step()
            if on_step is not None:
                on_step(outputs)
            for output in outputs:
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
    return finished


def admit_all(engine: Engine, requests: list, *, keep_admitted: bool) -> list[str | None]:
    """Add every request to the engine; return, in order, None for each one admitted and the error of each refused.

    Every request is tried, so every bad one is found before the first step. Unless keep_admitted, one refusal
    withdraws all the admitted ones: nothing runs, and nothing is left in the engine.

    Args:
      engine: the engine to add to.
      requests: (request_id, make) pairs; make() returns add_request's keyword arguments (prompt_token_ids,
        sampling_params, prompt, cache_salt), or raises ValueError naming what is wrong with the request.
      keep_admitted: keep the good requests when some are refused.
    """
    errors = []
    for request_id, make in requests:
        try:
            engine.add_request(request_id, **make())
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    if not keep_admitted and any(error is not None for error in errors):
        for (request_id, _), error in zip(requests, errors, strict=True):
            if error is None:
                engine.withdraw(request_id)
    return errors


class BadRequestsError(ValueError):
    """Some lines could not be admitted; nothing ran."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def run_lines(
    engine: Engine,
    lines: list[PromptLine | BadLine],
    *,
    skip_bad_lines: bool = True,
    stream_to=None,
    progress: bool = False,
    on_record=None,
    should_stop=None,
    stop_reason="stopped",
) -> tuple[list[dict], float]:
    """Run every good line to completion; return one record per line in input order, and the wall time.

    Every line is tokenized and admitted before the first step, so a line that can never run is found at once.
    With skip_bad_lines False, any bad line raises BadRequestsError and nothing runs; otherwise bad lines
    become error records and the rest run.

    Args:
      engine: the engine to drive; it should have no unfinished requests.
      lines: parsed lines (PromptLine) and parse failures (BadLine).
      skip_bad_lines: run the good lines even when some are bad.
      stream_to: a text stream to write the first request's text to as it is generated (for one prompt).
      progress: show a tqdm bar of finished requests on stderr.
      on_record: called with each finished request's record the step it finishes (e.g. to journal it).
      should_stop: called before every step; once it returns True, the requests still running or waiting are
        aborted, and their records say finish_reason "abort" with `stop_reason` as their "reason".
      stop_reason: why requests were aborted, for their records: a string, or a function that returns one.
    """
    tokenizer = engine.loaded.tokenizer

    def request_of(line: PromptLine | BadLine) -> dict:
        if isinstance(line, BadLine):
            raise ValueError(line.error)
        if line.messages is not None:
            text, token_ids = encode_chat(tokenizer, line.messages)
        else:
            text = line.prompt if isinstance(line.prompt, str) else None
            token_ids = encode_prompt(tokenizer, line.prompt)
        return dict(
            prompt_token_ids=token_ids,
            sampling_params=line.sampling_params,
            prompt=text,
            cache_salt=line.cache_salt,
            final_only=stream_to is None,  # a streamed run's first request needs its outputs as they come
        )

    requests = [(line.request_id, functools.partial(request_of, line)) for line in lines]
    errors = admit_all(engine, requests, keep_admitted=skip_bad_lines)
    records: dict[int, dict] = {}
    admitted: dict[str, int] = {}
    for index, (line, error) in enumerate(zip(lines, errors, strict=True)):
        if error is None:
            admitted[line.request_id] = index
            continue
        if isinstance(line, PromptLine):  # a parse error already names its line
            where = f"line {line.line_number}: " if line.line_number is not None else f"prompt {line.request_id}: "
            errors[index] = error = f"{where}{error}"
        records[index] = result_record(line.line_number, line.request_id, error=error)
    if not skip_bad_lines and records:
        raise BadRequestsError([error for error in errors if error is not None])
    start = time.perf_counter()
    stream_id = next(iter(admitted), None) if stream_to is not None else None
    streamed = {"chars": 0}
    # Text that could still become the start of a stop string (which is cut off) waits until it cannot.
    stops = lines[admitted[stream_id]].sampling_params.stop if stream_id is not None else ()
    holdback = max((len(stop) for stop in stops), default=1) - 1

    def stream(outputs) -> None:
        for output in outputs:
            if output.request_id != stream_id:
                continue
            text = output.outputs[0].text
            ready = len(text) if output.finished else max(streamed["chars"], len(text) - holdback)
            stream_to.write(text[streamed["chars"] : ready] + ("\n" if output.finished else ""))
            stream_to.flush()
            streamed["chars"] = ready

    def record_finished(outputs) -> None:
        if stream_id is not None:
            stream(outputs)
        for output in outputs:
            if output.finished:
                index = admitted[output.request_id]
                records[index] = result_record(
                    lines[index].line_number, output.request_id, output, input_hash=lines[index].input_hash
                )
                if on_record is not None:
                    on_record(records[index])

    drain(engine, len(admitted), progress=progress, on_step=record_finished, should_stop=should_stop)
    for request_id, index in admitted.items():
        if index not in records:  # asked to stop: abort what is left, and say why
            output = engine.abort(request_id)
            records[index] = result_record(
                lines[index].line_number, request_id, output, input_hash=lines[index].input_hash
            )
            records[index]["reason"] = stop_reason() if callable(stop_reason) else stop_reason
    return [records[index] for index in range(len(lines))], time.perf_counter() - start
