"""Weight-precision quality report: bf16 weights and int8 weights (f32 activations, f32 accumulation) against f32.

    python scripts/eval_weight_quality.py [--candidates bfloat16,int8] [--num_sequences 200]
        [--out bench_results/weight_quality]

The method and texts of eval_kv_quality.py: --num_sequences windows of --length tokens, half natural English
from this machine's packages, half the model's own answers. Each window is teacher-forced through the model
loaded with f32 weights and again with each candidate's (all over an f32 KV pool), and compared position by
position: top-1 agreement of the next-token prediction and KL(f32 || candidate). Then the first half of every window
prompts 64 greedy tokens under each: the share of positions whose token equals f32's, and the share of
sequences identical throughout. Writes <out>.json and <out>.md.

Candidates: "bfloat16" (weights stored in bf16) and "int8" (models.load(quantization="int8"): weight-only int8 with
an f32 scale and min per 32 contraction rows and column, on the native CPU matmul).
"""

import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eval_kv_quality as kv_quality  # noqa: E402  (its flags: --model, --num_sequences, --length, ...)

FLAGS = flags.FLAGS
FLAGS.set_default("out", "bench_results/weight_quality")

CANDIDATES = {
    "bfloat16": ({"dtype": "bfloat16"}, "bfloat16 weights, f32 activations and accumulation"),
    "int8": (
        {"quantization": "int8"},
        "int8 weights with an f32 scale and min per 32 weights of a column, f32 activations and sums",
    ),
}
flags.DEFINE_string(
    "candidates", "bfloat16,int8", f"Comma-separated weight formats to compare with f32: {list(CANDIDATES)}."
)


def main(argv):
    del argv
    import models
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    start = time.perf_counter()
    names = FLAGS.candidates.split(",")
    unknown = [name for name in names if name not in CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; choose from {list(CANDIDATES)}")
    reference_model = models.load(FLAGS.model, dtype="float32", compute_dtype="float32")
    candidates = {name: models.load(FLAGS.model, compute_dtype="float32", **CANDIDATES[name][0]) for name in names}
    windows, _ = kv_quality.evaluation_windows(reference_model)

    agree = {name: [] for name in names}
    kls = {name: [] for name in names}
    for first in range(0, len(windows), FLAGS.batch):
        chunk = windows[first : first + FLAGS.batch]
        reference = kv_quality.teacher_forced_logits(reference_model, chunk, "float32")
        for name, candidate_model in candidates.items():
            candidate = kv_quality.teacher_forced_logits(candidate_model, chunk, "float32")
            same, kl = kv_quality.compare_logits(reference, candidate)
            agree[name].append(np.asarray(same))
            kls[name].append(np.asarray(kl))

    half = FLAGS.length // 2
    prompts = [window[:half] for window in windows]
    baseline = kv_quality.greedy(reference_model, prompts, "float32", FLAGS.greedy_tokens)
    results = {}
    for name, candidate_model in candidates.items():
        continuation = kv_quality.greedy(candidate_model, prompts, "float32", FLAGS.greedy_tokens)
        pairs = list(zip(baseline, continuation, strict=True))
        results[name] = kv_quality.agreement(np.concatenate(agree[name]), np.concatenate(kls[name]), pairs)
    positions = int(sum(a.size for a in agree[names[0]]))
    model_name = FLAGS.model or "SmolLM2-135M-Instruct (embedded GGUF)"
    report = {
        "model": model_name,
        "baseline": "float32 weights",
        "candidates": {name: CANDIDATES[name][1] for name in names},
        "num_sequences": len(windows),
        "length": FLAGS.length,
        "positions": positions,
        "greedy_tokens": FLAGS.greedy_tokens,
        "results": results,
        "seconds": time.perf_counter() - start,
    }
    lines = [
        f"Weight formats vs f32 weights on {model_name} (f32 activations and KV): {len(windows)} windows of "
        f"{FLAGS.length} tokens ({positions} positions), half natural text, half generated answers; greedy: "
        f"{FLAGS.greedy_tokens} tokens after the first {half}.",
        "",
        f"| weights | {kv_quality.TABLE_COLUMNS}",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(kv_quality.table_row(name, results[name]) for name in names),
    ]
    kv_quality.write_report(FLAGS.out, report, lines)


if __name__ == "__main__":
    app.run(main)
