"""RequestStream: one HTTP request's prompts in the engine, from submission to the last output, on the server's
event loop.

The engine thread hands each prompt's outputs to an asyncio queue; the stream turns them into one whole response
or into server-sent-event chunks, observes the latency histograms, and aborts whatever has not finished when the
client goes away (a cancelled handler or stream), so its pages return to the pool within one step.
"""

import asyncio
import json
import time
import uuid

from starlette.responses import Response

from paxkv.core.outputs import RequestOutput
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.serving.engine_loop import EngineDeadError, EngineLoop
from paxkv.serving.openai_protocol import APIError, error_body
from paxkv.serving.openai_responses import (
    ChoiceStream,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    usage,
)
from paxkv.serving.server_metrics import ServerMetrics


class _QueueSink:
    """An OutputSink that posts (prompt index, output or error) to the event loop's queue, from the engine thread."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        self._event_loop, self._queue, self._index = event_loop, queue, index

    def put(self, output: RequestOutput) -> None:
        self._post(output)

    def fail(self, error: BaseException) -> None:
        self._post(error)

    def _post(self, item) -> None:
        try:
            self._event_loop.call_soon_threadsafe(self._queue.put_nowait, (self._index, item))
        except RuntimeError:  # the event loop has closed: nobody waits for this output
            pass


class _Latency:
    """One prompt's token times, for the TTFT, inter-token and end-to-end histograms."""

    def __init__(self, arrival: float):
        self.arrival, self.last, self.num_tokens = arrival, None, 0

    def observe(self, output: RequestOutput, metrics: ServerMetrics) -> None:
        now = time.monotonic()
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        new = num_tokens - self.num_tokens
        if new > 0:
            if self.last is None:
                metrics.time_to_first_token.observe(now - self.arrival)
                others, gap = new - 1, 0.0
            else:
                others, gap = new, now - self.last
            for _ in range(others):  # tokens of one step (accepted drafts, or n samples) share its gap
                metrics.inter_token_latency.observe(gap / others)
            self.last, self.num_tokens = now, num_tokens
        if output.finished:
            metrics.e2e_request_latency.observe(now - self.arrival)


class RequestStream:
    """The engine requests of one HTTP request: one per prompt, each with n samples."""

    def __init__(
        self,
        loop: EngineLoop,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        cache_salt: str | None,
        priority: int,
        metrics: ServerMetrics,
        *,
        max_waiting_requests: int,
        retry_after_seconds: int,
    ):
        """Args:
        loop: the engine loop.
        prompts: (text or None, token ids) per prompt.
        params: each prompt's SamplingParams.
        cache_salt, priority: as Engine.add_request takes them.
        metrics: the histograms to observe.
        max_waiting_requests: refuse (503) when more requests than this would be waiting.
        retry_after_seconds: the Retry-After of that refusal.
        """
        self.loop, self.prompts, self.params, self.metrics = loop, prompts, params, metrics
        self.cache_salt, self.priority = cache_salt, priority
        self.max_waiting_requests, self.retry_after_seconds = max_waiting_requests, retry_after_seconds
        self.request_ids: list[str] = []
        self.finals: list[RequestOutput | None] = [None] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._latency = [_Latency(time.monotonic()) for _ in prompts]

    async def submit(self) -> None:
        """Queue every prompt and wait until the engine admitted all of them; else abort them all and raise the
        first refusal (400 for a bad request, 503 when overloaded or the engine is gone)."""
        if self.loop.num_pending + len(self.prompts) > self.max_waiting_requests:
            raise APIError(
                503, f"the server already has {self.loop.num_pending} requests waiting (its limit is "
                f"{self.max_waiting_requests}); retry later", headers={"Retry-After": str(self.retry_after_seconds)},
            )  # fmt: skip
        event_loop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        admissions = []
        try:
            for index, ((text, token_ids), params) in enumerate(zip(self.prompts, self.params, strict=True)):
                request_id = f"{base}-{index}"
                admitted = event_loop.create_future()
                arguments = dict(
                    prompt_token_ids=token_ids, sampling_params=params, prompt=text, cache_salt=self.cache_salt,
                    priority=self.priority,
                )  # fmt: skip
                self.loop.add(
                    request_id, arguments, _QueueSink(event_loop, self._queue, index),
                    lambda error, future=admitted: event_loop.call_soon_threadsafe(_settle, future, error),
                )  # fmt: skip
                self.request_ids.append(request_id)
                admissions.append(admitted)
            errors = await asyncio.gather(*admissions)
        except EngineDeadError as e:
            self.abort()
            raise APIError(503, str(e)) from None
        except BaseException:  # the client left while its requests were being admitted
            self.abort()
            raise
        for index, error in enumerate(errors):
            if error is None:
                continue
            self.abort()
            if isinstance(error, EngineDeadError):
                raise APIError(503, str(error))
            if isinstance(error, ValueError):
                where = "the prompt" if len(self.prompts) == 1 else f"prompt {index}"
                raise APIError(400, str(error).replace(f"request {self.request_ids[index]!r}", where))
            raise APIError(500, f"adding the request failed ({type(error).__name__}); the server logged the details")

    def abort(self) -> None:
        """Abort every prompt that has not finished (the engine thread frees their pages before its next step)."""
        for index, request_id in enumerate(self.request_ids):
            if self.finals[index] is None:
                self.loop.abort(request_id)

    async def _next(self) -> tuple[int, RequestOutput]:
        """The next output of any prompt; an engine failure raises APIError."""
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise APIError(503 if isinstance(item, EngineDeadError) else 500, f"the engine failed: {item}")
        self._latency[index].observe(item, self.metrics)
        if item.finished:
            self.finals[index] = item
        return index, item

    async def _collect(self) -> list[RequestOutput]:
        while any(final is None for final in self.finals):
            await self._next()
        return self.finals

    async def whole_response(self, request, kind: str, model: str, num_logprobs: int | None) -> dict | Response:
        """Wait for every prompt to finish and return the whole response; abort everything if the client leaves
        (and answer 499, which nobody reads).

        Args:
          request: the HTTP request (watched for a disconnect).
          kind: "completion" or "chat".
          model: the served model's name.
          num_logprobs: top log-probabilities per token, or None.
        """
        collect = asyncio.ensure_future(self._collect())
        disconnect = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, disconnect):
                task.cancel()
        if collect not in done:
            self.abort()
            return Response(status_code=499)
        outputs = collect.result()
        if kind == "chat":
            return chat_response(f"chatcmpl-{uuid.uuid4().hex}", model, outputs[0], num_logprobs)
        return completion_response(f"cmpl-{uuid.uuid4().hex}", model, outputs, num_logprobs)

    async def completion_chunks(self, response_id: str, model: str, num_logprobs: int | None, include_usage: bool):
        """Server-sent events of /v1/completions: one chunk per choice that advanced, then usage, then [DONE]."""
        created = int(time.time())

        def chunk(choice: int, text: str, logprobs, finish_reason, stop_reason) -> dict:
            body = {"index": choice, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:
                body["stop_reason"] = stop_reason
            return {"id": response_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [body]}  # fmt: skip

        def logprobs_of(tokens, entries, text_offset):
            return None if num_logprobs is None else completion_logprobs(tokens, entries, num_logprobs, text_offset)

        async for event in self._events(chunk, logprobs_of, include_usage, "text_completion", response_id, model):
            yield event

    async def chat_chunks(self, response_id: str, model: str, num_logprobs: int | None, include_usage: bool):
        """Server-sent events of /v1/chat/completions: the assistant role, then content deltas, usage, [DONE]."""
        created = int(time.time())
        roles_sent: set[int] = set()

        def chunk(choice: int, text: str, logprobs, finish_reason, stop_reason) -> dict:
            delta = {} if finish_reason is not None and not text else {"content": text}
            if choice not in roles_sent:
                roles_sent.add(choice)
                delta = {"role": "assistant", **delta}
            body = {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:
                body["stop_reason"] = stop_reason
            return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [body]}  # fmt: skip

        def logprobs_of(tokens, entries, text_offset):
            return None if num_logprobs is None else chat_logprobs(tokens, entries, num_logprobs)

        async for event in self._events(chunk, logprobs_of, include_usage, "chat.completion.chunk", response_id, model):
            yield event

    async def _events(self, chunk, logprobs_of, include_usage: bool, kind: str, response_id: str, model: str):
        """The SSE lines both endpoints share; whatever has not finished when the client leaves is aborted."""
        streams: dict[int, ChoiceStream] = {}
        done: set[int] = set()
        try:
            while any(final is None for final in self.finals):
                try:
                    index, output = await self._next()
                except APIError as e:  # the engine failed mid-stream: say so, then end the stream
                    yield _event(error_body(e.status, e.message))
                    break
                num_samples = self.params[index].n
                for completion in output.outputs:
                    choice = index * num_samples + completion.index
                    if choice in done:
                        continue
                    stream = streams.setdefault(choice, ChoiceStream(self.params[index].stop))
                    offset = stream.num_chars
                    text, tokens, entries = stream.advance(completion)
                    finish_reason = completion.finish_reason
                    if not text and not tokens and finish_reason is None:
                        continue
                    if finish_reason is not None:
                        done.add(choice)
                    logprobs = logprobs_of(tokens, entries, offset) if tokens else None
                    yield _event(chunk(choice, text, logprobs, finish_reason, completion.stop_reason))
            else:
                if include_usage:
                    yield _event({"id": response_id, "object": kind, "created": int(time.time()), "model": model,
                                  "choices": [], "usage": usage(self.finals)})  # fmt: skip
            yield "data: [DONE]\n\n"
        finally:
            self.abort()


def _event(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _settle(future: asyncio.Future, error) -> None:
    if not future.done():
        future.set_result(error)


async def _disconnected(request) -> None:
    """Return once the client has closed the connection (the body has been read, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
