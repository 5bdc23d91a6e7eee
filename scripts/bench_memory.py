"""KV memory benchmark: prefix caching on and off (`prefix`), and memory pressure (`pressure`), each in one run.

    python scripts/bench_memory.py --workload prefix [--users 64] [--out bench_results/bench_memory]
    python scripts/bench_memory.py --workload pressure [--out bench_results/bench_memory_pressure]

Workload `pressure` (scripts/memory_pressure.py), over 1,000 lognormal sequence lengths (mean 300, capped at
2,048 = max_model_len) and SmolLM2's KV bytes per token:
  (a) paged (16-token pages, paxkv's PageAllocator) against contiguous max_model_len slots at one KV budget:
      KV waste and concurrent sequences;
  (b) FP8 (e4m3, scales included) against bf16 KV at the same budget: token capacity and concurrency;
  (c) overload: --overload_requests requests against a pool of 25% of their demand, preempting by recompute,
      swap and auto, on a seeded random Llama (hidden 256, 4 layers; built with transformers, the test extra);
  (d) page sizes 4-128 (--page_sizes): KV waste and block-table entries on (a)'s lengths, and decode tok/s on
      SmolLM2 at batch 32 (--decode_shape) on this machine's attention path.
Plots (with the `bench` extra): concurrency against KV budget (contiguous, paged, paged + FP8), and waste
and decode throughput against page size.

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # memory_pressure, throughput_models

FLAGS = flags.FLAGS
flags.DEFINE_enum("workload", "prefix", ["prefix", "pressure"], "Which workload to run.")
flags.DEFINE_integer("overload_requests", 500, "Requests in the pressure workload's overload part.")
flags.DEFINE_float("budget_gib", 1.0, "KV budget of the pressure workload's parts (a) and (b), in GiB.")
flags.DEFINE_list("page_sizes", ["4", "8", "16", "32", "64", "128"], "The pressure workload's page sizes in (d).")
flags.DEFINE_list(
    "decode_shape", ["32", "128", "24"], "The pressure workload's decode in (d): batch, prompt length, new tokens."
)
flags.DEFINE_string(
    "overload_model",
    None,
    "Model of the pressure workload's overload part (c); default: bench_throughput's random Llama.",
)
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
    from paxkv.core.engine import Engine
    from paxkv.scheduling.sampling_params import SamplingParams

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


def pressure(loaded) -> dict:
    """The four parts of the pressure workload."""
    import tempfile

    import memory_pressure as mp

    from paxkv.execution.kv_pool import QUANTIZED_NAMES, kv_bytes_per_token

    config = loaded.config
    per_token = {
        name: kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        for name, dtype in (("bfloat16", "bfloat16"), ("fp8_e4m3", QUANTIZED_NAMES["fp8_e4m3"]), ("int8", "int8"))
    }
    max_model_len, page_size = 2048, 16
    lengths = mp.lognormal_lengths(1000, 300, max_model_len, FLAGS.seed)
    budget = int(FLAGS.budget_gib * 2**30)
    part_a = mp.paged_vs_contiguous(lengths, budget // per_token["bfloat16"], max_model_len, page_size)
    fp8_tokens = budget // per_token["fp8_e4m3"]
    part_b = {
        "bytes_per_token": per_token,
        "bf16_tokens": budget // per_token["bfloat16"],
        "fp8_tokens": fp8_tokens,
        "fp8_concurrency": mp.paged_fill(lengths, fp8_tokens, page_size),
        "bf16_concurrency": part_a["paged_concurrency"],
    }
    part_b["capacity_ratio"] = part_b["fp8_tokens"] / part_b["bf16_tokens"]
    part_b["concurrency_ratio"] = part_b["fp8_concurrency"] / part_b["bf16_concurrency"]
    curve = mp.concurrency_curve(
        lengths, [int(g * 2**30) for g in (0.25, 0.5, 1, 2, 4, 8)], per_token, max_model_len, page_size
    )
    sweep = mp.page_size_waste(lengths, [int(size) for size in FLAGS.page_sizes])
    batch, prompt_len, new_tokens = (int(size) for size in FLAGS.decode_shape)
    for row in sweep:
        row["decode_tokens_per_s"] = mp.decode_throughput(loaded, row["page_size"], batch, prompt_len, new_tokens)
    with tempfile.TemporaryDirectory() as folder:
        import models

        if FLAGS.overload_model is None:
            from throughput_models import save_random_llama

            save_random_llama(folder)
        overload_model = models.load(FLAGS.overload_model or folder, require_tokenizer=False)
        overload = mp.overload(overload_model, FLAGS.overload_requests, 0.25, FLAGS.seed)
    return {
        "lengths": {"count": len(lengths), "mean": float(lengths.mean()), "max_model_len": max_model_len},
        "budget_gib": FLAGS.budget_gib,
        "a": part_a,
        "b": part_b,
        "curve": curve,
        "c": overload,
        "d": sweep,
    }


def pressure_markdown(result: dict) -> str:
    """The pressure workload's four tables."""
    a, b = result["a"], result["b"]
    lines = [
        f"Pressure workload on {result['machine']}: {result['lengths']['count']} lognormal lengths, mean "
        f"{result['lengths']['mean']:.0f}, max_model_len {result['lengths']['max_model_len']}; KV budget "
        f"{result['budget_gib']} GiB of SmolLM2 KV.",
        "",
        "(a) Paged vs contiguous (bf16 KV)",
        "",
        "| allocation | KV waste | concurrent sequences |",
        "|---|---:|---:|",
        f"| contiguous (max_model_len each) | {100 * a['contiguous_waste']:.1f}% | {a['contiguous_concurrency']} |",
        f"| paged, 16-token pages | {100 * a['paged_waste']:.2f}% | {a['paged_concurrency']} "
        f"({a['paged_concurrency'] / max(a['contiguous_concurrency'], 1):.1f}x) |",
        "",
        "(b) FP8 vs bf16 at the same budget",
        "",
        "| KV | bytes/token | token capacity | concurrent sequences |",
        "|---|---:|---:|---:|",
        f"| bf16 | {b['bytes_per_token']['bfloat16']} | {b['bf16_tokens']} | {b['bf16_concurrency']} |",
        f"| fp8 e4m3 (or int8) + bf16 scales | {b['bytes_per_token']['fp8_e4m3']} | {b['fp8_tokens']} | "
        f"{b['fp8_concurrency']} |",
        f"| ratio | | {b['capacity_ratio']:.2f}x | {b['concurrency_ratio']:.2f}x |",
        "",
        "(c) Overload: 25% of demand (random Llama, CPU; each mode warmed up before any is timed)",
        "",
        "| preemption | finished | tok/s | recompute | swap | pages swapped | tokens recomputed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["c"]:
        lines.append(
            f"| {row['mode']} | {row['finished']} | {row['generated_tokens_per_s']:.1f} | "
            f"{row['preemptions_recompute']} | {row['preemptions_swap']} | {row['pages_swapped']} | "
            f"{row['recomputed_tokens']} |"
        )
    lines += [
        "",
        "(d) Page size",
        "",
        f"| page size | KV waste | block-table entries / seq | decode tok/s (batch {FLAGS.decode_shape[0]}) |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["d"]:
        lines.append(
            f"| {row['page_size']} | {100 * row['waste']:.2f}% | {row['block_table_entries']:.1f} | "
            f"{row['decode_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def pressure_plots(result: dict, prefix: str) -> list[str]:
    """Concurrency against budget, and waste and throughput against page size, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    figure, axis = plt.subplots(figsize=(6, 4))
    budgets = [row["budget_gib"] for row in result["curve"]]
    for key, label in (("contiguous", "contiguous"), ("paged", "paged bf16"), ("paged_fp8", "paged fp8")):
        axis.plot(budgets, [row[key] for row in result["curve"]], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("KV budget (GiB)")
    axis.set_ylabel("concurrent sequences")
    axis.legend()
    figure.tight_layout()
    figure.savefig(prefix + "_concurrency.png", dpi=120)
    plt.close(figure)
    figure, waste_axis = plt.subplots(figsize=(6, 4))
    sizes = [row["page_size"] for row in result["d"]]
    waste_axis.plot(sizes, [100 * row["waste"] for row in result["d"]], marker="o", color="#cc3333")
    waste_axis.set_xscale("log", base=2)
    waste_axis.set_xlabel("page size (tokens)")
    waste_axis.set_ylabel("KV waste (%)", color="#cc3333")
    speed_axis = waste_axis.twinx()
    speed_axis.plot(sizes, [row["decode_tokens_per_s"] for row in result["d"]], marker="s", color="#3366cc")
    speed_axis.set_ylabel(f"decode tok/s at batch {FLAGS.decode_shape[0]}", color="#3366cc")
    figure.tight_layout()
    figure.savefig(prefix + "_page_size.png", dpi=120)
    plt.close(figure)
    return [prefix + "_concurrency.png", prefix + "_page_size.png"]


def main(argv):
    del argv
    import jax

    import models
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    loaded = models.load(FLAGS.model)
    machine = f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__} {jax.default_backend()}"
    if FLAGS.workload == "pressure":
        result = {"workload": "pressure", "machine": machine, **pressure(loaded)}
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        result["charts"] = pressure_plots(result, FLAGS.out)
        with open(FLAGS.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        table = pressure_markdown(result)
        with open(FLAGS.out + ".md", "w") as f:
            f.write(table)
        print(table)
        return
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
