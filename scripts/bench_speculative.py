"""Speculative decoding (n-gram prompt lookup) against plain decoding, interleaved in one process and one run.

    python scripts/bench_speculative.py --batches 1,8,32 --repeats 2 --out bench_results/speculative

Two workloads on the embedded SmolLM2 (or --model), f32 weights (or --dtype), greedy and sampled (--temperatures):
- "copy" (input-grounded): chat requests to repeat, tidy or extract from a passage of about 1k tokens (sections
  of this repository's BUILD.md) given in the prompt, where prompt lookup finds drafts. Four passages are
  shared by the batch's requests, so the prefix cache holds them after the warm-ups and the runs time decoding;
- "open": short open questions, where drafts rarely come up, and adaptive speculation should cost nothing.

Each (workload, temperature, batch) runs plain decoding, adaptive speculation and always-on speculation (and, with
--control, plain decoding again in a second engine: two identical engines differ by a few percent here), one
after the other, `--warmups` untimed times (they compile the step programs and fill the prefix cache; more, up to
`--max_warmups`, while the last one still compiled a program: adaptive speculation compiles a new step shape only
once the work repays it, so it may take several runs to reach its steady state) and then `--repeats` timed
times, every other repeat in reverse order. A configuration's speedup is the median over the repeats of plain
decoding's time over its own in the same repeat (the machines here drift by 10% within minutes: ratios of neighbouring
runs cancel that drift, where a ratio of two medians would not), and the table shows their range. Every
configuration must generate the same tokens as plain decoding (seeded sampling included; the run fails otherwise).
Writes <out>.json, <out>.md and <out>.png.
"""

import json
import os
import platform
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "What models.load takes; default: the embedded SmolLM2.")
flags.DEFINE_string("dtype", "float32", "Weight dtype: float32 or bfloat16 (bf16 operands, f32 accumulation on CPU).")
flags.DEFINE_string("batches", "1,8,32", "Comma-separated request counts, all submitted at once.")
flags.DEFINE_string("workloads", "copy,open", "copy and/or open.")
flags.DEFINE_string("temperatures", "0,0.8", "Comma-separated sampling temperatures (0 is greedy).")
flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
flags.DEFINE_integer("num_speculative_tokens", 4, "Most drafts per request and step.")
flags.DEFINE_integer("repeats", 2, "Timed runs per configuration.")
flags.DEFINE_integer("warmups", 2, "Untimed runs per configuration first, which compile the shapes the runs take.")
flags.DEFINE_integer(
    "max_warmups", 8, "Untimed runs, up to this many in all, while the last one compiled a step program (steady state)."
)
flags.DEFINE_integer("passage_chars", 4000, "Characters per passage of the copy workload (about 1k tokens).")
flags.DEFINE_integer("min_padded_seqs", None, "The row floor (EngineConfig.min_padded_seqs; default: the engine's).")
flags.DEFINE_integer("min_padded_tokens", 1, "The token floor (EngineConfig.min_padded_tokens).")
flags.DEFINE_string("kv_cache_memory", "1GiB", "Each configuration's target KV pool (a draft model's follows it).")
flags.DEFINE_boolean(
    "control",
    True,
    "Also run a second plain engine ('plain_again'), measured as the others: the spread between two identical "
    "engines in this run, the noise floor of every 'vs plain'.",
)


def _readable_memory_size(text: str) -> bool:
    """Whether --kv_cache_memory reads as a size (absl reports the flag and the message below when not)."""
    from paxkv.entrypoints.config_flags import parse_memory_size

    try:
        return parse_memory_size(text) > 0
    except ValueError:
        return False


flags.register_validator("kv_cache_memory", _readable_memory_size, "write a positive size, e.g. 16MiB or 1GiB")
flags.DEFINE_string("out", "bench_results/speculative", "Output path prefix for .json, .md and .png.")
flags.DEFINE_string(
    "draft_model",
    None,
    "Also measure a draft model (adaptive and always drafting): a checkpoint with the target's vocabulary, or "
    "'embedded' for the embedded SmolLM2 itself (the only model with its vocabulary this machine has).",
)
flags.DEFINE_string(
    "configs",
    None,
    "Comma-separated configurations to run besides plain (ngram_adaptive, ngram_always, draft_adaptive, "
    "draft_always); default: all that the other flags enable.",
)
flags.DEFINE_bool(
    "draft_always",
    True,
    "With --draft_model, measure it drafting every proposal as well as adaptively (--nodraft_always: adaptive "
    "alone, for the cases where always drafting is known to lose and would take most of the run's time).",
)

SAMPLE_PASSAGES = [
    "The page pool holds fixed-size pages of keys and values. Each sequence owns a block table that maps its "
    "logical pages to physical ones, so memory is allocated on demand and freed the moment a request ends.",
    "def merge(left, right):\n    result = []\n    while left and right:\n        if left[0] <= right[0]:\n"
    "            result.append(left.pop(0))\n        else:\n            result.append(right.pop(0))\n"
    "    return result + left + right\n",
]


def _passages(num_chars: int) -> list[str]:
    """Four passages of `num_chars` characters: consecutive stretches of BUILD.md's prose, or where it is not
    beside this script, the sample passages repeated."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BUILD.md")
    if os.path.exists(path):
        text = open(path, encoding="utf-8").read()
    else:
        text = " ".join(SAMPLE_PASSAGES) * (1 + 4 * num_chars // len(" ".join(SAMPLE_PASSAGES)))
    return [text[i * num_chars : (i + 1) * num_chars] for i in range(4)]


TASKS = [
    "{}\n\nRepeat the text above exactly, word for word.",
    "{}\n\nCopy the first paragraph of the text above, changing nothing.",
    "{}\n\nList every file name that the text above mentions, with the sentence that mentions it.",
    "{}\n\nRewrite the first paragraph above with every sentence on its own line.",
]
QUESTIONS = [
    "Why is the sky blue?",
    "Give three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Describe a good breakfast.",
    "How do vaccines work?",
    "Write a short poem about autumn.",
]
CONFIGS = {
    "plain": None,
    "ngram_adaptive": {"method": "ngram", "adaptive": True},
    "ngram_always": {"method": "ngram", "adaptive": False},
}


def _messages(workload: str, count: int) -> list[list[dict]]:
    if workload == "copy":
        passages = _passages(FLAGS.passage_chars)
        texts = [TASKS[(i // len(passages)) % len(TASKS)].format(passages[i % len(passages)]) for i in range(count)]
    else:
        texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return [[{"role": "user", "content": text}] for text in texts]


def _proposal_seconds(context: int = 8192, steps: int = 200) -> dict:
    """Prompt lookup's host cost per step at `context` tokens: indexing the prompt once, then per decoding step."""
    import numpy as np

    from paxkv.speculation.ngram_proposer import NgramIndex

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 49152, context).tolist()
    output: list[int] = []
    index = NgramIndex(1, 4)
    start = time.perf_counter()
    index.propose(prompt, output, 4)  # drafts, match length: only the time matters here
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        output.append(int(rng.integers(0, 49152)))
        index.propose(prompt, output, 4)
    return dict(context=context, first_seconds=first, per_step_seconds=(time.perf_counter() - start) / steps)


def _run(llm, prompts, max_tokens: int, temperature: float) -> tuple[float, list[list[int]], dict]:
    """One timed generate: seconds, every output's tokens, and the engine's counters for this run."""
    from paxkv import SamplingParams

    metrics = llm.engine.metrics
    names = ("num_draft_tokens", "num_accepted_draft_tokens", "num_speculative_rows", "num_steps")
    before = [getattr(metrics, name) for name in names]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    # Programs the run asked to be compiled in the background finish before the next run (counted as this run's).
    llm.engine.runner.ahead.wait()
    counts = [getattr(metrics, name) - b for name, b in zip(names, before, strict=True)]
    counters = dict(zip(("drafts", "accepted", "rows", "steps"), counts, strict=True))
    return seconds, [o.outputs[0].token_ids for o in outputs], counters


def main(argv):
    del argv
    import jax

    from paxkv import LLM
    from paxkv.entrypoints.batch_runner import encode_chat
    from paxkv.entrypoints.config_flags import parse_memory_size

    batches = [int(b) for b in FLAGS.batches.split(",")]
    configs = dict(CONFIGS)
    if FLAGS.draft_model:
        from models.loading import embedded_model_path

        draft = embedded_model_path() if FLAGS.draft_model == "embedded" else FLAGS.draft_model
        configs["draft_adaptive"] = {"method": "draft_model", "model": draft, "adaptive": True}
        if FLAGS.draft_always:
            configs["draft_always"] = {"method": "draft_model", "model": draft, "adaptive": False}
    if FLAGS.configs:
        chosen = set(FLAGS.configs.split(","))
        unknown = chosen - set(configs)
        if unknown:
            raise SystemExit(f"--configs: unknown or not enabled {sorted(unknown)}; choose from {sorted(configs)}")
        configs = {name: speculative for name, speculative in configs.items() if name == "plain" or name in chosen}
    if FLAGS.control:
        configs["plain_again"] = None  # an A/A control: plain decoding in a second engine
    engines = {}
    for name, speculative in configs.items():
        if speculative is not None:
            speculative = {**speculative, "num_speculative_tokens": FLAGS.num_speculative_tokens}
        engines[name] = LLM(
            FLAGS.model,
            dtype=FLAGS.dtype,
            max_num_seqs=max(batches),
            min_padded_seqs=FLAGS.min_padded_seqs,
            min_padded_tokens=FLAGS.min_padded_tokens,
            kv_cache_memory_bytes=parse_memory_size(FLAGS.kv_cache_memory),
            speculative_config=speculative,
        )
    tokenizer = engines["plain"].loaded.tokenizer
    rows = []
    cases = [
        (workload, float(temperature), batch)
        for workload in FLAGS.workloads.split(",")
        for temperature in FLAGS.temperatures.split(",")
        for batch in batches
    ]
    for workload, temperature, batch in cases:
        prompts = [{"prompt_token_ids": encode_chat(tokenizer, m)[1]} for m in _messages(workload, batch)]
        reference = None
        times = {name: [] for name in configs}
        counters = {}
        compiled = {name: 0 for name in configs}
        mismatched = {name: 0 for name in configs}
        num_warmups = FLAGS.warmups
        repeat = 0
        while repeat < num_warmups + FLAGS.repeats:
            compiled_in_run = False
            # Every other repeat runs the configurations in reverse order, so that a machine slowing down or speeding
            # up over a repeat weighs on each configuration alike.
            order = list(engines.items())
            for name, llm in order if repeat % 2 == 0 else order[::-1]:
                programs = llm.engine.num_compilations  # the draft model's programs too
                seconds, tokens, counts = _run(llm, prompts, FLAGS.max_tokens, temperature)
                reference = tokens if reference is None else reference
                # Requests whose tokens differ from plain decoding's. Greedy ones must not; a sampled one may where
                # two tokens' Gumbel-perturbed logits lie within float rounding of each other (a step that computes
                # drafts as one chunk rounds differently), which the count reports instead of hiding.
                mismatched[name] = max(mismatched[name], sum(t != r for t, r in zip(tokens, reference, strict=True)))
                if temperature == 0 and mismatched[name]:
                    raise SystemExit(f"{name} changed greedy tokens ({workload}, batch {batch})")
                compiled_in_run |= llm.engine.num_compilations > programs
                if repeat >= num_warmups:
                    times[name].append(seconds)
                    counters[name] = counts
                    compiled[name] += llm.engine.num_compilations - programs
            if repeat == num_warmups - 1 and compiled_in_run and num_warmups < FLAGS.max_warmups:
                num_warmups += 1  # a warm-up still compiled: one more, so the timed runs see the steady state
            repeat += 1
        generated = sum(len(t) for t in reference)
        for name in configs:
            seconds = statistics.median(times[name])
            # Paired: each repeat's plain time over this configuration's in the same repeat, run next to each other.
            ratios = [p / s for p, s in zip(times["plain"], times[name], strict=True)]
            counts = counters[name]
            rows.append(
                dict(
                    workload=workload,
                    temperature=temperature,
                    batch=batch,
                    config=name,
                    tokens_per_s=generated / seconds,
                    speedup=statistics.median(ratios),
                    speedup_range=[min(ratios), max(ratios)],
                    acceptance=counts["accepted"] / counts["drafts"] if counts["drafts"] else None,
                    tokens_per_step=generated / counts["steps"] if counts["steps"] else None,
                    mean_accepted_length=counts["accepted"] / counts["rows"] if counts["rows"] else None,
                    ms_per_step=1000 * seconds / counts["steps"] if counts["steps"] else None,
                    drafts=counts["drafts"],
                    steps=counts["steps"],
                    seconds=times[name],
                    # Step programs first seen in the timed runs (their compile time is in the figure).
                    programs_compiled_while_timed=compiled[name],
                    warmup_runs=num_warmups,
                    requests_differing_from_plain=mismatched[name],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    proposal = _proposal_seconds()
    plain_steps = [r for r in rows if r["config"] == "plain" and r["batch"] == min(batches)]
    step_seconds = min(statistics.median(r["seconds"]) / r["steps"] for r in plain_steps)
    proposal["share_of_a_plain_step"] = proposal["per_step_seconds"] / step_seconds
    result = dict(
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), jax=jax.__version__),
        proposal_cost=proposal,
        model=(FLAGS.model or "SmolLM2-135M-Instruct (embedded GGUF)") + f", {FLAGS.dtype} weights",
        max_tokens=FLAGS.max_tokens,
        num_speculative_tokens=FLAGS.num_speculative_tokens,
        draft_model=FLAGS.draft_model,
        rows=rows,
    )
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(FLAGS.out + ".md", "w") as f:
        f.write(_markdown(result))
    _plot(result, FLAGS.out + ".png")
    print(_markdown(result))


def _markdown(result: dict) -> str:
    lines = [
        f"Speculative decoding, {result['model']}, {result['max_tokens']} new tokens, up to "
        f"{result['num_speculative_tokens']} drafts per step; greedy tokens are identical in every configuration, "
        "and sampled ones (seeded per request) up to float near-ties (the 'differ' column: requests whose tokens "
        "differ from plain decoding's).",
        "",
        f"Prompt lookup at {result['proposal_cost']['context']} tokens of context: "
        f"{1e6 * result['proposal_cost']['per_step_seconds']:.1f} us a step per request "
        f"({100 * result['proposal_cost']['share_of_a_plain_step']:.2f}% of a plain step at the smallest batch), "
        f"{1e3 * result['proposal_cost']['first_seconds']:.0f} ms to index the prompt once.",
        "",
        "Vs plain: the median over the repeats of plain decoding's time over the configuration's in the same repeat "
        "(range: the least and most of those ratios). plain_again, where present, is plain decoding in a second "
        "engine: its 'vs plain' is the spread between two identical engines, this run's noise floor.",
        "",
        "| workload | temperature | batch | config | tok/s | vs plain | range | acceptance | accepted per step | "
        "tokens per step | ms per step | differ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    for row in result["rows"]:
        acceptance = "—" if row["acceptance"] is None else f"{100 * row['acceptance']:.0f}%"
        lines.append(
            f"| {row['workload']} | {row['temperature']:g} | {row['batch']} | {row['config']} | "
            f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
            f"{row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f} | {acceptance} | "
            f"{fmt(row['mean_accepted_length'], '.2f')} | {fmt(row['tokens_per_step'], '.2f')} | "
            f"{fmt(row['ms_per_step'], '.1f')} | {row['requests_differing_from_plain']} |"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: str) -> bool:
    """Speedup over plain decoding against batch size, one line per workload and configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install -e .[bench])")
        return False
    figure, axis = plt.subplots(figsize=(6, 4))
    keys = sorted({(row["workload"], row["config"]) for row in result["rows"] if row["config"] != "plain"})
    for workload, config in keys:
        points = [
            (r["batch"], r["speedup"]) for r in result["rows"] if (r["workload"], r["config"]) == (workload, config)
        ]
        axis.plot(*zip(*points, strict=True), marker="o", label=f"{workload}, {config}")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch (requests at once)")
    axis.set_ylabel("tok/s vs plain decoding")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


if __name__ == "__main__":
    app.run(main)
