"""Prefill time of one prompt and model load time: paxkv vs HF transformers, interleaved in one run.

    python scripts/bench_prefill.py --prompt_tokens 512 --repeats 5 --out bench_results/prefill

Writes <out>.json and <out>.md. Both systems compute in f32 on the CPU with the same weights (the embedded
SmolLM2 GGUF, dequantized, or --model's HF folder) and return last-token logits only.
"""

import json
import os
import platform
import statistics
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "An HF folder (safetensors) both systems load; default: the embedded SmolLM2 GGUF.")
flags.DEFINE_integer("prompt_tokens", 512, "Prompt length.")
flags.DEFINE_integer("repeats", 5, "Timed runs per system (after one warm-up each).")
flags.DEFINE_integer("threads", 2, "torch threads (JAX uses every core).")
flags.DEFINE_string("out", "bench_results/prefill", "Output path prefix for .json and .md.")


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv):
    del argv
    import torch
    from transformers import AutoModelForCausalLM

    import models
    from models.paged_forward import PagedSequence
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    torch.set_num_threads(FLAGS.threads)
    if FLAGS.model is None:
        gguf_path = models.embedded_model_path()
        hf_source = dict(
            pretrained_model_name_or_path=os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
        )
    else:
        hf_source = dict(pretrained_model_name_or_path=FLAGS.model)

    paxkv_load_s, loaded = _timed(lambda: models.load(FLAGS.model, require_tokenizer=False))
    loaded.pack_for_native_matmul()  # as an engine runs it
    hf_load_s, hf_model = _timed(lambda: AutoModelForCausalLM.from_pretrained(**hf_source, dtype=torch.float32).eval())
    prompt = np.random.default_rng(0).integers(100, loaded.config.vocab_size, FLAGS.prompt_tokens)
    prompt_torch = torch.tensor(prompt)[None]

    def paxkv_prefill():
        sequence = PagedSequence(loaded.graphdef, loaded.state, loaded.config, max_tokens=len(prompt))
        return sequence.feed(prompt, all_logits=False)[-1]

    def hf_prefill():
        with torch.no_grad():
            return hf_model(prompt_torch, logits_to_keep=1).logits[0, -1].numpy()

    paxkv_first_s, paxkv_logits = _timed(paxkv_prefill)  # includes compilation (or a cache load)
    _, hf_logits = _timed(hf_prefill)
    times = {"paxkv": [], "transformers": []}
    for _ in range(FLAGS.repeats):  # interleaved, so machine noise hits both alike
        times["paxkv"].append(_timed(paxkv_prefill)[0])
        times["transformers"].append(_timed(hf_prefill)[0])

    best = {name: min(ts) for name, ts in times.items()}
    result = {
        "model": FLAGS.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)",
        "prompt_tokens": FLAGS.prompt_tokens,
        "repeats": FLAGS.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "prefill_best_s": best,
        "prefill_median_s": {name: statistics.median(ts) for name, ts in times.items()},
        "prefill_tokens_per_s": {name: FLAGS.prompt_tokens / t for name, t in best.items()},
        "prefill_speedup_paxkv_over_transformers": best["transformers"] / best["paxkv"],
        "paxkv_first_call_s": paxkv_first_s,
        "load_s": {"paxkv": paxkv_load_s, "transformers": hf_load_s},
        "last_logits_max_abs_diff": float(np.abs(paxkv_logits - hf_logits).max()),
        "same_next_token": bool(np.argmax(paxkv_logits) == np.argmax(hf_logits)),
    }
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    table = [
        f"# Prefill of a {FLAGS.prompt_tokens}-token prompt, SmolLM2-135M f32, {result['machine']}",
        "",
        "| system | best prefill (s) | median (s) | prompt tok/s | load (s) |",
        "|---|---|---|---|---|",
    ]
    for name in ("paxkv", "transformers"):
        table.append(
            f"| {name} | {best[name]:.3f} | {result['prefill_median_s'][name]:.3f} | "
            f"{result['prefill_tokens_per_s'][name]:.0f} | {result['load_s'][name]:.1f} |"
        )
    table += [
        "",
        f"paxkv / transformers prefill speed: {result['prefill_speedup_paxkv_over_transformers']:.2f}x; "
        f"paxkv first call (compile or cache load): {paxkv_first_s:.2f} s; "
        f"last-token logits max |diff| {result['last_logits_max_abs_diff']:.2e}.",
    ]
    with open(FLAGS.out + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    app.run(main)
