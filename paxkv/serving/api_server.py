"""The OpenAI-compatible HTTP API over an EngineLoop (FastAPI): /v1/completions and /v1/chat/completions (whole, or
streamed as server-sent events), /v1/models, /health, /metrics (Prometheus), /tokenize and /detokenize.

Every error is an OpenAI-shaped JSON body, never a traceback, and concerns its own request only.
"""

import dataclasses
import hashlib
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paxkv.entrypoints.batch_runner import encode_chat, encode_prompt
from paxkv.serving.engine_loop import EngineLoop
from paxkv.serving.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from paxkv.serving.openai_responses import response_id
from paxkv.serving.request_stream import RequestStream
from paxkv.serving.server_metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the API serves and its limits. `paxkv serve`'s flags set these."""

    model_name: str  # the name clients give as "model"
    max_model_len: int
    api_keys: tuple[str, ...] = ()  # when set, /v1/*, /tokenize and /detokenize need Authorization: Bearer <key>
    salt_by_api_key: bool = False  # every key's requests get a cache salt of their own (tenants share no pages)
    max_waiting_requests: int = 1024  # beyond this many requests not yet running, answer 503 with Retry-After
    max_request_bytes: int = 8 << 20  # a larger body is refused with 413
    retry_after_seconds: int = 1


def build_app(loop: EngineLoop, tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI application over a started EngineLoop.

    Args:
      loop: the engine loop (its engine's model must have a tokenizer).
      tokenizer: the model's tokenizer.
      config: names and limits.
    """
    app = FastAPI(title="paxkv", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(loop)
    app.state.metrics = metrics
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, error: Exception):
        logger.exception("request failed")
        message = f"internal error ({type(error).__name__}); the server logged the details"
        return JSONResponse(error_body(500, message), status_code=500)

    async def read_body(request: Request, model: type[BaseModel]):
        """The JSON body parsed into `model`: 415 for another content type, 413 over the size limit, 400 for bad
        JSON or a bad field."""
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}")
        limit = config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the body has {declared} bytes; this server takes at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body exceeds this server's limit of {limit} bytes")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the body must be a JSON object, not {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            problem = e.errors()[0]
            param = ".".join(str(part) for part in problem["loc"]) or None
            raise APIError(400, f"{param}: {problem['msg']}" if param else problem["msg"], param=param) from None

    def authorize(request: Request) -> str | None:
        """The caller's API key (None when the server has none); 401 without a valid one."""
        if not config.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header Authorization: Bearer <key>", code="invalid_api_key")
        matched = None
        for key in config.api_keys:  # every key compared, each in constant time
            if hmac.compare_digest(token.encode(), key.encode()):
                matched = key
        if matched is None:
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return matched

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {config.model_name!r} (GET /v1/models)",
                param="model", code="model_not_found",
            )  # fmt: skip

    def cache_salt(api_key: str | None, salt: str | None) -> str | None:
        if not (config.salt_by_api_key and api_key):
            return salt
        tenant = hashlib.sha256(api_key.encode()).hexdigest()[:16]
        return f"{tenant}:{salt or ''}"

    def stream_for(
        body, api_key: str | None, prompts: list[tuple[str | None, list[int]]], num_logprobs
    ) -> RequestStream:
        """Validate the sampling fields against each prompt and make the request's stream (not yet submitted)."""
        try:
            params = [
                body.sampling_params(len(token_ids), config.max_model_len, num_logprobs) for _, token_ids in prompts
            ]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return RequestStream(
            loop, prompts, params, cache_salt(api_key, body.cache_salt), body.priority, metrics,
            max_waiting_requests=config.max_waiting_requests, retry_after_seconds=config.retry_after_seconds,
        )  # fmt: skip

    def encode(prompt) -> list[int]:
        try:
            return encode_prompt(tokenizer, prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        api_key = authorize(request)
        body = await read_body(request, CompletionRequest)
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported; the prompt is in your request", param="echo")
        prompts = [(p if isinstance(p, str) else None, encode(p)) for p in body.prompts()]
        stream = stream_for(body, api_key, prompts, body.logprobs)
        await stream.submit()
        if body.stream:
            chunks = stream.completion_chunks(response_id("cmpl"), config.model_name, body.logprobs, body.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await stream.whole_response(request, "completion", config.model_name, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        api_key = authorize(request)
        body = await read_body(request, ChatCompletionRequest)
        check_model(body.model)
        messages = [message.as_template_message(index) for index, message in enumerate(body.messages)]
        try:
            text, token_ids = encode_chat(tokenizer, messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        num_logprobs = body.num_logprobs()
        stream = stream_for(body, api_key, [(text, token_ids)], num_logprobs)
        await stream.submit()
        if body.stream:
            chunks = stream.chat_chunks(response_id("chatcmpl"), config.model_name, num_logprobs, body.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return await stream.whole_response(request, "chat", config.model_name, num_logprobs)

    @app.get("/v1/models")
    async def list_models(request: Request):
        authorize(request)
        card = {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "paxkv",
            "max_model_len": config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        body = await read_body(request, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            messages = [message.as_template_message(index) for index, message in enumerate(body.messages)]
            try:
                _, token_ids = encode_chat(tokenizer, messages)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        else:
            try:
                token_ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        body = await read_body(request, DetokenizeRequest)
        check_model(body.model)
        vocab_size = tokenizer.vocab_size
        bad = [token for token in body.tokens if not 0 <= token < vocab_size]
        if bad:
            raise APIError(400, f"tokens outside the vocabulary [0, {vocab_size}): {bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        if loop.is_alive:
            return {"status": "ok", "steps": loop.num_steps}
        reason = f"the engine failed: {loop.error!r}" if loop.error is not None else "the engine is not running"
        return JSONResponse(error_body(503, reason), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
