"""paxkv's OpenAI API on a real uvicorn server (127.0.0.1, a free port), through the official openai client and raw
HTTP: outputs equal LLM.generate's, streams concatenate to whole responses, 64 streaming clients with disconnects
leak no page, and every bad request gets an OpenAI-shaped error that touches no other request."""

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from conftest import with_byte_level_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from subprocess_env import subprocess_env

from paxkv import LLM, SamplingParams
from paxkv.serving.api_server import ServerConfig, build_app
from paxkv.serving.engine_loop import EngineDeadError, EngineLoop

# Steps pad to 8 rows (TPU's row floor) and the 128-token budget, for fewer programs to compile (smaller steps:
# test_engine).
ENGINE = dict(
    num_pages=192,
    page_size=8,
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=128,
    min_padded_seqs=8,
    min_padded_tokens=128,
)
MODEL = "tiny-chat"
KEYS = ("key-a", "key-b")
PROMPTS = ["The sky is", "1, 2, 3,", "Once upon a time", "paged attention"]


class Served:
    """A uvicorn server over an EngineLoop, in a thread of its own."""

    def __init__(self, llm: LLM, config: ServerConfig):
        self.llm, self.engine = llm, llm.engine
        self.loop = EngineLoop(llm.engine).start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(self.loop, llm.loaded.tokenizer, config), log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.loop.stop()

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def post(self, path: str, json=None, key: str | None = KEYS[0], **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{path}", json=json, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)

    def wait_idle(self) -> None:
        """Until the engine thread has nothing left to run."""
        deadline = time.monotonic() + 30
        while self.loop.state.num_running or self.loop.num_pending:
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def chat_llama(engine_llama_checkpoint, tmp_path_factory):
    """The engine tests' tiny Llama with a byte-level tokenizer and a chat template."""
    return with_byte_level_tokenizer(engine_llama_checkpoint, tmp_path_factory.mktemp("chat_llama") / "model")


@pytest.fixture(scope="module")
def reference(chat_llama) -> LLM:
    """LLM.generate on an engine of its own over the same model and budgets."""
    return LLM(str(chat_llama), **ENGINE)


@pytest.fixture(scope="module")
def served(chat_llama):
    config = ServerConfig(
        model_name=MODEL, max_model_len=ENGINE["max_model_len"], api_keys=KEYS, salt_by_api_key=True,
        max_request_bytes=64 << 10,
    )  # fmt: skip
    server = Served(LLM(str(chat_llama), **ENGINE), config)
    yield server
    server.stop()


def test_greedy_completions_and_chat_equal_llm_generate(served, reference):
    client = served.client()
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in response.choices] == [output.outputs[0].text for output in expected]
    assert {choice.finish_reason for choice in response.choices} == {"length"}
    prompt_tokens = sum(len(output.prompt_token_ids) for output in expected)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 48)
    assert response.usage.total_tokens == prompt_tokens + 48 and response.model == MODEL

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paging?"}]
    (expected_chat,) = reference.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat.outputs[0].text
    assert chat.usage.prompt_tokens == len(expected_chat.prompt_token_ids) and chat.usage.completion_tokens == 10


def _streamed(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text by choice index, finish_reason by index, chunks) of a completions or chat stream."""
    texts, reasons, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_streams_concatenate_to_the_whole_response_with_n_seed_stop_and_usage(served, reference):
    client = served.client()
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0).choices[0].text
    stop = greedy[9:11]  # a stop string the greedy text reaches
    cut = greedy[: greedy.index(stop)]
    options = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
    assert client.completions.create(**options).choices[0].text == cut
    texts, reasons, _ = _streamed(client.completions.create(**options, stream=True))
    assert (texts, reasons) == ({0: cut}, {0: "stop"})

    sampled = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.8, seed=7, n=2)
    whole = client.completions.create(**sampled)
    assert whole.choices[0].text != whole.choices[1].text  # two samples, seeds 7 and 8
    (expected,) = reference.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=16), False)
    assert [c.text for c in whole.choices] == [c.text for c in expected.outputs]
    texts, reasons, chunks = _streamed(
        client.completions.create(**sampled, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {c.index: c.text for c in whole.choices} and reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "Tell me about pages."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.8, seed=3)
    whole_chat = client.chat.completions.create(**chat).choices[0].message.content
    texts, reasons, chunks = _streamed(
        client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: whole_chat} and reasons == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 12


def test_logprobs_are_the_engines_in_both_formats(served, reference):
    client = served.client()
    (expected,) = reference.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, logprobs=3), False)
    tokens, entries = expected.outputs[0].token_ids, expected.outputs[0].logprobs
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([entries[i][t].logprob for i, t in enumerate(tokens)], abs=1e-5)
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == response.choices[0].text and logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob for item in content)
    assert all(item.logprob == item.top_logprobs[0].logprob for item in content)  # greedy: the most likely token
    assert all(item.logprob != 0.0 for item in content)


async def _stream_one(client: httpx.AsyncClient, index: int, disconnect_after: int | None) -> str | None:
    """Stream one greedy completion; with disconnect_after, close the connection after that many chunks."""
    body = {"model": MODEL, "prompt": f"request {index}: the pages", "max_tokens": 16, "temperature": 0, "stream": True}
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if disconnect_after is not None and chunks >= disconnect_after:
                return None  # leaving the block closes the connection mid-stream
    return text


def test_64_streaming_clients_with_disconnects_leak_nothing(served, reference):
    rng = random.Random(0)
    plan = [rng.randint(1, 6) if index % 4 == 0 else None for index in range(64)]
    prompts = [f"request {index}: the pages" for index in range(64)]
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    before = served.loop.state.metrics

    async def run():
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=120) as client:
            return await asyncio.gather(*(_stream_one(client, i, after) for i, after in enumerate(plan)))

    texts = asyncio.run(run())
    for index, text in enumerate(texts):
        if plan[index] is None:
            assert text == expected[index].outputs[0].text, index
    served.wait_idle()
    metrics = served.loop.state.metrics
    assert metrics.kv_pages_used == 0  # every page is free or only held by the prefix cache
    assert metrics.kv_pages_free + metrics.kv_pages_cached_idle == metrics.num_total_pages
    finished = metrics.num_finished_requests - before.num_finished_requests
    aborted = metrics.num_aborted_requests - before.num_aborted_requests
    assert finished + aborted == 64 and finished >= 48 and aborted >= 1
    scraped = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
        for sample in family.samples
    }
    assert scraped["paxkv:kv_pages_used"] == 0 and scraped["paxkv:num_requests_running"] == 0
    assert scraped["paxkv:num_requests_waiting"] == 0
    assert scraped["paxkv:generation_tokens_total"] == metrics.num_generated_tokens
    assert scraped["paxkv:request_success_total"] == metrics.num_finished_requests
    assert scraped["paxkv:request_aborted_total"] == metrics.num_aborted_requests
    assert scraped["paxkv:prefix_cache_queries_total"] == metrics.prefix_query_tokens
    assert scraped["paxkv:time_to_first_token_seconds_count"] >= 64
    assert scraped["paxkv:e2e_request_latency_seconds_count"] >= finished


def test_a_stream_whose_client_leaves_before_its_first_chunk_is_aborted(served):
    """The client sends a streaming request and closes the connection at once: the request is aborted (not run to
    its max_tokens), and its pages go back."""
    before = served.loop.state.metrics
    body = json.dumps(
        {"model": MODEL, "prompt": "leaving early", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
         "stream": True}
    ).encode()  # fmt: skip
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    deadline = time.monotonic() + 30
    while served.loop.state.metrics.num_aborted_requests == before.num_aborted_requests:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.01)
    served.wait_idle()
    metrics = served.loop.state.metrics
    assert metrics.num_finished_requests == before.num_finished_requests  # it did not run to its 200 tokens
    assert metrics.num_generated_tokens - before.num_generated_tokens < 200 and metrics.kv_pages_used == 0


@pytest.mark.parametrize(
    "body,status,needle,param",
    [
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be at least 1", None),
        ({"prompt": "hi", "n": 0}, 400, "n must be at least 1", None),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0", None),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
        ({"max_tokens": 4}, 400, "prompt", "prompt"),
        ({"prompt": [7] * 300, "max_tokens": 1}, 400, "max_model_len", None),
        ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary", None),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "does not exist", "model"),
        ({"prompt": "hi", "echo": True}, 400, "echo is not supported", "echo"),
        ({"prompt": "x" * (80 << 10)}, 413, "takes at most 65536", None),
    ],
)
def test_bad_requests_get_openai_errors(served, body, status, needle, param):
    response = served.post("/v1/completions", {"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]
    assert error["param"] == param and "Traceback" not in response.text


def test_malformed_bodies_keys_and_unknown_fields(served):
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases = [
        (served.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400),
        (served.post("/v1/completions", content=b"prompt=hi", headers={"Content-Type": "text/plain"}), 415),
        (served.post("/v1/completions", json=good, key=None), 401),
        (served.post("/v1/completions", json=good, key="wrong"), 401),
        (served.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400),
        (served.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400),
        (served.post("/v1/nowhere", json=good), 404),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    ok = served.post("/v1/completions", json={**good, "frobnicate": 3, "user": "u1"})  # ignored, as OpenAI does
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_models_tokenize_detokenize_health_and_metrics(served):
    models = served.client().models.list()
    assert [model.id for model in models.data] == [MODEL]
    tokens = served.post("/tokenize", {"prompt": "héllo"}).json()
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6
    chat_tokens = served.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert bytes(chat_tokens).decode() == "user: hi\nassistant:"
    assert served.post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    assert served.post("/detokenize", {"tokens": [300]}).status_code == 400
    assert httpx.get(f"{served.url}/health").status_code == 200
    families = {
        family.name: family for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
    }
    names = ["num_requests_running", "num_requests_waiting", "kv_pages_used", "kv_pages_free", "kv_waste_ratio"]
    names += ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens"]
    for name in names:
        assert f"paxkv:{name}" in families, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert families[f"paxkv:{name}"].type == "histogram"
    assert {s.labels["kind"] for s in families["paxkv:num_preemptions"].samples} == {"recompute", "swap"}


def test_each_api_key_gets_its_own_prefix_cache(served):
    prompt = "A shared system prompt that fills several pages of eight tokens each. " * 2
    client_a, client_b = served.client(KEYS[0]), served.client(KEYS[1])

    def hits_after(client) -> int:
        before = served.loop.state.metrics.prefix_hit_tokens
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        served.wait_idle()
        return served.loop.state.metrics.prefix_hit_tokens - before

    hits_after(client_a)
    assert hits_after(client_a) > 0  # the same tenant shares its cached pages
    assert hits_after(client_b) == 0  # another key never does


def test_a_full_queue_answers_503_and_a_failed_engine_fails_health(chat_llama, monkeypatch):
    config = ServerConfig(model_name=MODEL, max_model_len=ENGINE["max_model_len"], max_waiting_requests=2)
    server = Served(LLM(str(chat_llama), **ENGINE), config)
    try:
        full = server.post("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2}, key=None)
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        assert "limit is 2" in full.json()["error"]["message"]
        assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 2}, key=None).status_code == 200

        def broken_step():
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(server.engine, "step", broken_step)
        failed = server.post("/v1/completions", {"prompt": "a", "max_tokens": 2}, key=None)
        assert failed.status_code == 500 and "injected device failure" in failed.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "injected device failure" in health.json()["error"]["message"]
        after = server.post("/v1/completions", {"prompt": "a", "max_tokens": 2}, key=None)
        assert after.status_code == 503 and "engine failed" in after.json()["error"]["message"]
    finally:
        server.stop()


def test_paxkv_serve_runs_and_stops_on_sigterm(chat_llama):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "paxkv.entrypoints.run", "serve", f"--model={chat_llama}", f"--port={port}"]
    command += ["--max_model_len=128", "--num_pages=64", "--page_size=8", "--max_num_batched_tokens=32"]
    command += ["--max_num_seqs=4", "--min_padded_seqs=8", "--min_padded_tokens=32"]
    process = subprocess.Popen(command, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"model": "model", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal, so the process ends as SIGTERM's (143 in a shell).
        assert process.wait(60) == -signal.SIGTERM
        stderr = process.stderr.read()
        assert f"http://127.0.0.1:{port}/v1" in stderr and "Finished server process" in stderr, stderr
        # (32, 4), every step padding to its 4 rows and 32 tokens: with greedy rows only, and with rows that draw.
        assert "# warm-up: 2 step shapes compiled" in stderr
    finally:
        process.kill()


def test_serve_refuses_more_than_one_process():
    run = subprocess.run(
        [sys.executable, "-m", "paxkv.entrypoints.run", "serve", "--num_processes=2", "--process_id=0",
         "--coordinator_address=127.0.0.1:1"],
        env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0 and "serve runs in one process" in run.stderr and "Traceback" not in run.stderr


class _ListSink:
    """An OutputSink that records what the engine thread hands it."""

    def __init__(self):
        self.outputs, self.errors, self.done = [], [], threading.Event()

    def put(self, output):
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, error):
        self.errors.append(error)
        self.done.set()


def test_stopping_the_loop_answers_every_request(chat_llama):
    """Shutdown loses nothing: a running request ends with finish_reason "abort", and a later add is refused."""
    llm = LLM(str(chat_llama), **ENGINE)
    loop = EngineLoop(llm.engine).start()
    sink, admitted = _ListSink(), []
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    loop.add("long", dict(prompt_token_ids=[1, 2, 3], sampling_params=params), sink, admitted.append)
    deadline = time.monotonic() + 30
    while not sink.outputs:  # running: it has produced a token
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loop.stop()
    assert admitted == [None] and sink.done.is_set() and not sink.errors
    assert sink.outputs[-1].finished and sink.outputs[-1].outputs[0].finish_reason == "abort"
    assert not loop.is_alive and llm.engine.metrics.kv_pages_used == 0
    with pytest.raises(EngineDeadError, match="shutting down"):
        loop.add("late", dict(prompt_token_ids=[1], sampling_params=params), _ListSink(), admitted.append)
