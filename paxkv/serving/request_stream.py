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
    response_id,
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
            return chat_response(response_id("chatcmpl"), model, outputs[0], num_logprobs)
        return completion_response(response_id("cmpl"), model, outputs, num_logprobs)

    async def completion_chunks(self, stream_id: str, model: str, num_logprobs: int | None, include_usage: bool):
        """Server-sent events of /v1/completions: one chunk per choice that advanced, then usage, then [DONE]."""

        def choice_body(choice: int, text: str, tokens, entries, text_offset: int) -> dict:
            logprobs = None
            if num_logprobs is not None and tokens:
                logprobs = completion_logprobs(tokens, entries, num_logprobs, text_offset)
            return {"index": choice, "text": text, "logprobs": logprobs}

        async for event in self._events(choice_body, "text_completion", stream_id, model, include_usage):
            yield event

    async def chat_chunks(self, stream_id: str, model: str, num_logprobs: int | None, include_usage: bool):
        """Server-sent events of /v1/chat/completions: the assistant role, then content deltas, usage, [DONE]."""
        roles_sent: set[int] = set()

        def choice_body(choice: int, text: str, tokens, entries, text_offset: int) -> dict:
            delta = {"content": text} if text else {}
            if choice not in roles_sent:  # the first chunk of each choice names the role
                roles_sent.add(choice)
                delta = {"role": "assistant", **delta}
            logprobs = None
            if num_logprobs is not None and tokens:
                logprobs = chat_logprobs(tokens, entries, num_logprobs)
            return {"index": choice, "delta": delta, "logprobs": logprobs}

        async for event in self._events(choice_body, "chat.completion.chunk", stream_id, model, include_usage):
            yield event

    async def _events(self, choice_body, kind: str, stream_id: str, model: str, include_usage: bool):
        """The SSE lines both endpoints share: each chunk's envelope, finish reasons, usage, [DONE]; whatever has not
        finished when the client leaves is aborted.

        Args:
          choice_body: (choice index, new text, new token ids, their logprob entries, the text's offset in the
            choice) -> the endpoint's choice object.
          kind: the chunks' "object".
          stream_id, model: the chunks' "id" and "model".
          include_usage: end with a usage chunk.
        """
        created = int(time.time())
        envelope = {"id": stream_id, "object": kind, "created": created, "model": model}
        streams: dict[int, ChoiceStream] = {}
        done: set[int] = set()
        try:
            while any(final is None for final in self.finals):
                try:
                    index, output = await self._next()
                except APIError as e:  # the engine failed mid-stream: say so, then end the stream
                    yield _event(error_body(e.status, e.message))
                    break
                for completion in output.outputs:
                    choice = index * self.params[index].n + completion.index
                    if choice in done:
                        continue
                    stream = streams.setdefault(choice, ChoiceStream(self.params[index].stop))
                    offset = stream.num_chars
                    text, tokens, entries = stream.advance(completion)
                    finish_reason = completion.finish_reason
                    if not text and not tokens and finish_reason is None:
                        continue
                    body = {**choice_body(choice, text, tokens, entries, offset), "finish_reason": finish_reason}
                    if finish_reason is not None:
                        done.add(choice)
                        body["stop_reason"] = completion.stop_reason
                    yield _event({**envelope, "choices": [body]})
            else:
                if include_usage:
                    yield _event({**envelope, "choices": [], "usage": usage(self.finals)})
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
