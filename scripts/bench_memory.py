"""KV memory benchmark: how many pages a workload needs, with prefix caching on and off, measured in one run.

    python scripts/bench_memory.py --workload prefix [--users 64] [--out bench_results/bench_memory]

Workload `prefix` (a chatbot): one system prompt of --system_tokens random token ids shared by --users
concurrent users, each adding a question of --question_min..--question_max tokens and generating exactly
--new_tokens tokens (greedy, EOS ignored). Every request is added at once; the engine runs to the end, once
with prefix caching and once without, on the same model (the embedded SmolLM2 unless --model), in one process.

Reported per mode: peak KV pages held by requests (a shared page counts once), prefill tokens skipped (prefix
hits), preemptions and generated tokens per second of wall time. The optimum is the pages needed if every
distinct token whose KV is ever computed were stored once, packed densely: the system prompt once, plus each
user's question and its generated tokens but the last (whose KV is never computed). The gap to it is given in
pages per request.

Writes <out>.json, <out>.md and, when matplotlib is installed (the `bench` extra), <out>.png: a bar chart of
peak KV pages (off, on, optimum).
"""

import json
import math
import os
import platform
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_enum("workload", "prefix", ["prefix"], "Which workload to run.")
flags.DEFINE_string("model", None, "A model for models.load (default: the embedded SmolLM2).")
flags.DEFINE_integer("users", 64, "Concurrent users.")
flags.DEFINE_integer("system_tokens", 1000, "Tokens in the shared system prompt.")
flags.DEFINE_integer("question_min", 50, "Shortest question, in tokens.")
flags.DEFINE_integer("question_max", 200, "Longest question, in tokens.")
flags.DEFINE_integer("new_tokens", 128, "Tokens each user generates.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("max_num_batched_tokens", 1024, "Token budget per step.")
flags.DEFINE_integer("seed", 0, "Seed for the random prompts.")
flags.DEFINE_string("out", "bench_results/bench_memory", "Output path prefix for .json, .md and .png.")


def prefix_workload(vocab_size: int) -> list[list[int]]:
    """The chatbot prompts: one shared system prompt, then each user's question."""
    rng = np.random.default_rng(FLAGS.seed)
    # Stay clear of the low ids, where special tokens usually sit.
    system = rng.integers(100, vocab_size, FLAGS.system_tokens).tolist()
    lengths = rng.integers(FLAGS.question_min, FLAGS.question_max + 1, FLAGS.users)
    return [system + rng.integers(100, vocab_size, int(n)).tolist() for n in lengths]


def run_mode(loaded, prompts: list[list[int]], caching: bool) -> dict:
    """Run every prompt at once through a fresh engine; return its memory and speed figures."""
    from paxkv.config import EngineConfig
    from paxkv.engine import Engine
    from paxkv.sampling_params import SamplingParams

    page_size, new_tokens = FLAGS.page_size, FLAGS.new_tokens
    # Room for every request without sharing, so neither mode is ever preempted and both are measured unconstrained.
    num_pages = 1 + sum(math.ceil((len(p) + new_tokens) / page_size) for p in prompts) + len(prompts)
    config = EngineConfig(
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        max_model_len=max(map(len, prompts)) + new_tokens,
        enable_prefix_caching=caching,
    )
    engine = Engine(loaded, config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"user-{index}", prompt, params)
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(output.finished for output in engine.step())
    wall = time.perf_counter() - start
    metrics = engine.metrics
    assert finished == len(prompts)
    return {
        "prefix_caching": caching,
        "num_pages": num_pages,
        "peak_kv_pages": metrics.peak_kv_pages_used,
        "prefill_tokens_skipped": metrics.prefix_hit_tokens,
        "prefix_hit_rate": metrics.prefix_hit_rate,
        "computed_tokens": metrics.num_computed_tokens,
        "preemptions": metrics.num_preemptions,
        "wall_seconds": wall,
        "generated_tokens_per_s": metrics.num_generated_tokens / wall,
        "compilations": metrics.num_compilations,
    }


def optimum_pages(prompts: list[list[int]]) -> float:
    """Pages if every distinct computed token were stored once, densely: the shared prompt once, the rest per user."""
    distinct = FLAGS.system_tokens + sum(len(p) - FLAGS.system_tokens + FLAGS.new_tokens - 1 for p in prompts)
    return distinct / FLAGS.page_size


def markdown(result: dict) -> str:
    """The result as a markdown table."""
    on, off = result["on"], result["off"]
    lines = [
        f"Prefix workload: {result['users']} users, a {result['system_tokens']}-token system prompt, questions of "
        f"{result['question_range'][0]}-{result['question_range'][1]} tokens, {result['new_tokens']} new tokens; "
        f"page size {result['page_size']}; {result['model']} on {result['machine']}.",
        "",
        "| | peak KV pages | vs off | pages/request over optimum | prefill tokens skipped | generated tok/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    optimum, users = result["optimum_pages"], result["users"]
    for label, row in (("caching off", off), ("caching on", on)):
        lines.append(
            f"| {label} | {row['peak_kv_pages']} | {100 * row['peak_kv_pages'] / off['peak_kv_pages']:.0f}% | "
            f"{(row['peak_kv_pages'] - optimum) / users:.2f} | {row['prefill_tokens_skipped']} | "
            f"{row['generated_tokens_per_s']:.1f} |"
        )
    lines.append(f"| optimum | {optimum:.0f} | {100 * optimum / off['peak_kv_pages']:.0f}% | 0 | | |")
    lines += [
        "",
        f"KV saving with caching: {result['saving_percent']:.1f}%. Throughput on/off: {result['speedup']:.2f}x.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """A bar chart of peak KV pages (off, on, optimum), if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = ["caching off", "caching on", "optimum"]
    values = [result["off"]["peak_kv_pages"], result["on"]["peak_kv_pages"], result["optimum_pages"]]
    figure, axis = plt.subplots(figsize=(6, 4))
    bars = axis.bar(labels, values, color=["#999999", "#3366cc", "#33aa55"])
    axis.bar_label(bars, labels=[f"{v:.0f}" for v in values])
    axis.set_ylabel("peak KV pages")
    axis.set_title(f"{result['users']} users sharing a {result['system_tokens']}-token system prompt")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv):
    del argv
    import jax

    import models
    from paxkv.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    loaded = models.load(FLAGS.model)
    prompts = prefix_workload(loaded.config.vocab_size)
    off = run_mode(loaded, prompts, caching=False)
    on = run_mode(loaded, prompts, caching=True)
    result = {
        "workload": FLAGS.workload,
        "model": FLAGS.model or "SmolLM2-135M-Instruct (embedded)",
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}",
        "users": FLAGS.users,
        "system_tokens": FLAGS.system_tokens,
        "question_range": [FLAGS.question_min, FLAGS.question_max],
        "new_tokens": FLAGS.new_tokens,
        "page_size": FLAGS.page_size,
        "off": off,
        "on": on,
        "optimum_pages": optimum_pages(prompts),
        "saving_percent": 100 * (1 - on["peak_kv_pages"] / off["peak_kv_pages"]),
        "speedup": on["generated_tokens_per_s"] / off["generated_tokens_per_s"],
    }
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    result["chart"] = FLAGS.out + ".png" if plot(result, FLAGS.out + ".png") else None
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(FLAGS.out + ".md", "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    app.run(main)
