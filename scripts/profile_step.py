"""Where one decode step's time goes (or one speculative verification step's, --num_drafts): host scheduling, input
building, device, and inside the device.

    python scripts/profile_step.py --batch 32 --prompt_len 128 --steps 32 --out bench_results/profile_step

Runs B requests of random prompts on the embedded SmolLM2 (f32; --model for another) through the Engine, then
times --steps decode steps phase by phase (schedule, StepInputs + SamplingArrays, the jitted step until its result
is ready, the host bookkeeping after it). It then splits the same decode batch's device work into parts: the step's
forward compiled whole and with attention, the KV write, the MLP and the attention block's other work removed one
after another, all run in turn so that a noisy machine slows each alike (spread_ms gives the noise), plus the
lm_head and the sampler alone. With --prefill it splits the first prefill step instead (every prompt's first chunk,
up to 2048 tokens) and times no decode steps. Writes <out>.json and <out>.md.
"""

import json
import os
import statistics
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 32, "Sequences decoding together.")
flags.DEFINE_integer("prompt_len", 128, "Prompt tokens per sequence.")
flags.DEFINE_integer("steps", 32, "Decode steps to time.")
flags.DEFINE_bool(
    "prefill",
    False,
    "Split the first prefill step instead (every prompt's first chunk, up to 2048 tokens) and skip the decode phases.",
)
flags.DEFINE_integer("num_pages", None, "Page pool size (default: just enough for the batch).")
flags.DEFINE_integer(
    "num_drafts",
    0,
    "Speculative drafts per sequence and step (prompt lookup, always drafting, over prompts that repeat a 16-token "
    "pattern): profiles the verification step of speculative decoding instead of plain decode.",
)
flags.DEFINE_string("model", None, "A model for models.load (default: the embedded SmolLM2).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight storage dtype (activations stay f32 on CPU).")
flags.DEFINE_enum(
    "kv_cache_dtype", "auto", ["auto", "float32", "bfloat16", "int8"], "KV pool dtype (auto: the activations')."
)
flags.DEFINE_enum("quantization", "none", ["none", "int8"], "Weight quantization (models.load's; int8 needs float32).")
flags.DEFINE_string("out", "bench_results/profile_step", "Output path prefix for .json and .md.")


class _PhaseTimer:
    """Wraps callables so each call's wall time is added to a named list."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}

    def wrap(self, name, fn, block=False):
        import jax

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if block:
                jax.block_until_ready(result)
            self.times.setdefault(name, []).append(time.perf_counter() - start)
            return result

        return timed


def _median_ms(values) -> float:
    return 1e3 * statistics.median(values)


def _device_split(engine, loaded, rounds: int = 20) -> dict:
    """Median ms of the decode batch's step, whole and with parts removed one after another, plus the lm_head and
    the sampler alone.

    Each variant is the step's forward compiled with one more part of every layer replaced: attention by the KV
    write alone, then the KV write too, then the MLP with its norm, then the attention block's norm, projections and
    RoPE (each block's norm runs in its first native product, models.layers.project_together and GatedMLP).
    Consecutive differences give each part's share; what is left is the embedding, the lm_head and the sampler.
    Every variant is compiled first and the variants then run in turn, `rounds` times, so a slow spell of a
    shared machine falls on all of them alike; `spread_ms` is the largest interquartile range among them, the
    noise a part's figure carries.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models.layers
    from pallas_kernels import write_kv
    from paxkv.execution.step import forward_step, sample_step, step_model

    # The batch is only read here (never run through Engine.step), so the scheduler needs no update.
    batch = engine.scheduler.schedule()
    step_batch, with_logprobs = engine.runner.step_batch(batch, engine.outputs.seed_of)
    greedy_only = step_batch.greedy_only()  # the sampling variant the engine would run
    num_rows = step_batch.sampling.temperature.shape[-1]
    draft_indices = None if step_batch.drafts is None else step_batch.drafts.logits_indices
    sampling_batch = dataclasses.replace(step_batch, inputs=None)
    caches = jax.tree.map(jnp.copy, engine.kv_caches)
    graph, weights = step_model(loaded.graphdef, loaded.state)  # the model as the step programs take it

    def compile_forward():
        # Equal graphdefs share one StaticGraph, so only clearing jit's caches makes the patched model retrace.
        jax.clear_caches()
        return forward_step.trace(graph, weights, caches, step_batch.inputs, draft_indices).lower().compile()

    def write_only(q, k, v, kv_pages, metadata, *, attention_impl, **kwargs):
        # As paged_attention writes: a bf16 pool through the native in-place write under cpu_native (XLA:CPU's bf16
        # scatter copies the whole pool, which attention_ms would have gone negative for).
        return q, write_kv(kv_pages, k, v, metadata.slots, native=attention_impl == "cpu_native")

    def nothing(q, k, v, kv_pages, metadata, **kwargs):
        # k and v stay used (a sum, times zero: XLA keeps float x * 0, which may be NaN), or XLA would drop their
        # projections and RoPE too, and kv_write_ms would count them.
        return q + 0.0 * (jnp.sum(k) + jnp.sum(v)), kv_pages

    def no_mlp(self, x, norm=None):
        return jnp.zeros_like(x)

    def no_attention_block(self, x, rope, kv_pages, metadata, norm=None):
        return jnp.zeros_like(x), kv_pages

    removals = [
        ("attention", [(models.layers, "attention_on_mesh", write_only)]),
        ("kv_write", [(models.layers, "attention_on_mesh", nothing)]),
        ("mlp", [(models.layers.GatedMLP, "__call__", no_mlp)]),
        ("projections_rope_norms", [(models.layers.PagedAttention, "__call__", no_attention_block)]),
    ]
    originals = [
        (models.layers, "attention_on_mesh", models.layers.attention_on_mesh),
        (models.layers.GatedMLP, "__call__", models.layers.GatedMLP.__call__),
        (models.layers.PagedAttention, "__call__", models.layers.PagedAttention.__call__),
    ]
    forwards = {"device_step": compile_forward()}
    try:
        for part, patches in removals:
            for owner, name, replacement in patches:
                setattr(owner, name, replacement)
            forwards[part] = compile_forward()
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        jax.clear_caches()
    logits_info = jax.tree.leaves(forwards["device_step"].out_info)[0]
    logits_shape = jax.ShapeDtypeStruct(logits_info.shape, logits_info.dtype)
    native = engine.runner.native
    sampling = sample_step.trace(logits_shape, sampling_batch, with_logprobs, greedy_only, native).lower().compile()

    def run(forward):
        nonlocal caches
        logits, caches = forward(weights, caches, step_batch.inputs, draft_indices)
        return sampling(logits, sampling_batch)

    times = {name: [] for name in forwards}
    for forward in forwards.values():
        jax.block_until_ready(run(forward))  # warm
    for _ in range(rounds):
        for name, forward in forwards.items():
            start = time.perf_counter()
            jax.block_until_ready(run(forward))
            times[name].append(time.perf_counter() - start)
    medians = {name: _median_ms(values) for name, values in times.items()}
    split = {"tokens_per_step": batch.num_batched_tokens, "device_step_ms": medians["device_step"]}
    names = list(forwards)
    for previous, part in zip(names, names[1:], strict=False):
        split[f"{part}_ms"] = medians[previous] - medians[part]
    split["embedding_lm_head_sampling_ms"] = medians[names[-1]]
    quartiles = [statistics.quantiles(values, n=4) for values in times.values()]
    split["spread_ms"] = 1e3 * max(upper - lower for lower, _, upper in quartiles)

    def time_call(fn, *args):
        jax.block_until_ready(fn(*args))  # compile and warm
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append(time.perf_counter() - start)
        return _median_ms(samples)

    hidden = jnp.ones((num_rows, loaded.config.hidden_size), jnp.float32)
    logits_fn = jax.jit(lambda state, h: nnx.merge(loaded.graphdef, state).logits(h))
    split["lm_head_alone_ms"] = time_call(logits_fn, loaded.state, hidden)
    # The step's own sampling program (the native greedy kernel where every row is greedy on CPU).
    logits = logits_fn(loaded.state, hidden).reshape(logits_shape.shape)
    split["sampling_alone_ms"] = time_call(sampling, logits, sampling_batch)
    return split


def main(argv):
    del argv
    import jax

    import models
    import paxkv.execution.model_runner
    from paxkv.config import EngineConfig
    from paxkv.core.engine import Engine
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache
    from paxkv.execution.sampler import SamplingArrays
    from paxkv.execution.step_inputs import StepInputs
    from paxkv.scheduling.sampling_params import SamplingParams

    enable_compilation_cache()
    loaded = models.load(FLAGS.model, require_tokenizer=False, dtype=FLAGS.dtype, quantization=FLAGS.quantization)
    batch = FLAGS.batch
    total_tokens = FLAGS.prompt_len + FLAGS.steps + 16
    speculative = None
    if FLAGS.num_drafts:
        speculative = {"method": "ngram", "num_speculative_tokens": FLAGS.num_drafts, "adaptive": False}
        total_tokens += FLAGS.steps * FLAGS.num_drafts
    engine = Engine(
        loaded,
        EngineConfig(
            num_pages=FLAGS.num_pages or batch * (-(-total_tokens // 16) + 1) + 1,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=2048,
            max_model_len=total_tokens + 16,
            speculative_config=speculative,
            kv_cache_dtype=FLAGS.kv_cache_dtype,
        ),
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.steps * (1 + FLAGS.num_drafts) + 8, ignore_eos=True)

    def random_prompt() -> list[int]:
        tokens = rng.integers(100, loaded.config.vocab_size, FLAGS.prompt_len)
        if FLAGS.num_drafts:  # a repeated pattern, which the model continues and prompt lookup drafts
            tokens = np.resize(tokens[:16], FLAGS.prompt_len)
        return tokens.tolist()

    for index in range(batch):
        engine.add_request(str(index), random_prompt(), params)
    if FLAGS.prefill:
        return _report_prefill(engine, loaded)
    while any(request.num_output_tokens == 0 for request in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # compile and warm the decode shape

    timer = _PhaseTimer()
    original_from_batch = StepInputs.__dict__["from_batch"]
    original_from_params = SamplingArrays.__dict__["from_params"]
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    StepInputs.from_batch = timer.wrap("step_inputs", StepInputs.from_batch)
    SamplingArrays.from_params = timer.wrap("sampling_arrays", SamplingArrays.from_params)
    original_step = paxkv.execution.model_runner.run_step
    paxkv.execution.model_runner.run_step = timer.wrap("device", original_step, block=True)
    totals = []
    try:
        for _ in range(FLAGS.steps):
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
    finally:
        paxkv.execution.model_runner.run_step = original_step
        StepInputs.from_batch = original_from_batch
        SamplingArrays.from_params = original_from_params
        del engine.scheduler.schedule
    phases = {name: _median_ms(values) for name, values in timer.times.items()}
    phases["step_total"] = _median_ms(totals)
    phases["host_other"] = phases["step_total"] - sum(
        phases[name] for name in ("schedule", "step_inputs", "sampling_arrays", "device")
    )
    for request in list(engine.scheduler.running):
        engine.abort(request.request_id)
    engine = Engine(loaded, engine.config)  # a fresh pool with one decode batch, for the device split
    for index in range(batch):
        engine.add_request(str(index), random_prompt(), params)
    while any(request.num_output_tokens == 0 for request in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    split = _device_split(engine, loaded)
    result = {
        "batch": batch,
        "num_drafts": FLAGS.num_drafts,
        "tokens_per_step": split.pop("tokens_per_step"),
        "prompt_len": FLAGS.prompt_len,
        "dtype": FLAGS.dtype,
        "kv_cache_dtype": FLAGS.kv_cache_dtype,
        "quantization": FLAGS.quantization,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "phases_ms": phases,
        "device_split_ms": split,
    }
    weights = FLAGS.dtype if FLAGS.quantization == "none" else f"{FLAGS.quantization} (from {FLAGS.dtype})"
    title = f"# One decode step, batch {batch}, context ~{FLAGS.prompt_len}, {weights} weights (median ms)"
    if FLAGS.num_drafts:
        title += f", up to {FLAGS.num_drafts} drafts a sequence ({result['tokens_per_step']} tokens)"
    _write_report(result, title, "phase", {**phases, **split})


def _report_prefill(engine, loaded) -> None:
    """Print and write the device split of the engine's first step: every waiting prompt's first chunk."""
    import jax

    split = _device_split(engine, loaded)
    tokens = split.pop("tokens_per_step")
    result = {"batch": FLAGS.batch, "prompt_len": FLAGS.prompt_len, "dtype": FLAGS.dtype, "prefill": True}
    result["kv_cache_dtype"] = FLAGS.kv_cache_dtype
    result.update(backend=jax.default_backend(), cpu_count=os.cpu_count(), tokens_per_step=tokens)
    result["device_split_ms"] = split
    title = (
        f"# One prefill step of {tokens} tokens ({FLAGS.batch} prompts of {FLAGS.prompt_len}), {FLAGS.dtype} weights"
    )
    _write_report(result, title + " (median ms)", "part", split)


def _write_report(result: dict, title: str, heading: str, rows: dict) -> None:
    """Write result to <out>.json and the rows as a markdown table under the title to <out>.md, and print that."""
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        title,
        "",
        f"| {heading} | ms |",
        "|---|---|",
        *[f"| {name} | {value:.2f} |" for name, value in rows.items()],
    ]
    with open(FLAGS.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
