"""Weight-precision quality report: bf16 weights (f32 activations, f32 accumulation) against f32 weights.

    python scripts/eval_weight_quality.py [--num_sequences 200] [--out bench_results/weight_quality]

The method and texts of eval_kv_quality.py: --num_sequences windows of --length tokens, half natural English
from this machine's packages, half the model's own answers. Each window is teacher-forced through the model
loaded with f32 weights and again with bf16 weights (both over an f32 KV pool), and compared position by
position: top-1 agreement of the next-token prediction and KL(f32 || bf16). Then the first half of every window
prompts 64 greedy tokens under each: the share of positions whose token equals f32's, and the share of
sequences identical throughout. Writes <out>.json and <out>.md.
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

WEIGHT_DTYPES = ("float32", "bfloat16")


def main(argv):
    del argv
    import models
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache

    enable_compilation_cache()
    start = time.perf_counter()
    loaded = {dtype: models.load(FLAGS.model, dtype=dtype, compute_dtype="float32") for dtype in WEIGHT_DTYPES}
    reference_model, candidate_model = loaded["float32"], loaded["bfloat16"]
    windows, _ = kv_quality.evaluation_windows(reference_model)

    agree, kls = [], []
    for first in range(0, len(windows), FLAGS.batch):
        chunk = windows[first : first + FLAGS.batch]
        reference = kv_quality.teacher_forced_logits(reference_model, chunk, "float32")
        candidate = kv_quality.teacher_forced_logits(candidate_model, chunk, "float32")
        same, kl = kv_quality.compare_logits(reference, candidate)
        agree.append(np.asarray(same))
        kls.append(np.asarray(kl))
    same, kl = np.concatenate(agree), np.concatenate(kls)

    half = FLAGS.length // 2
    prompts = [window[:half] for window in windows]
    continuations = {
        dtype: kv_quality.greedy(model, prompts, "float32", FLAGS.greedy_tokens) for dtype, model in loaded.items()
    }
    pairs = list(zip(continuations["float32"], continuations["bfloat16"], strict=True))
    result = kv_quality.agreement(same, kl, pairs)
    model_name = FLAGS.model or "SmolLM2-135M-Instruct (embedded GGUF)"
    report = {
        "model": model_name,
        "baseline": "float32 weights",
        "candidate": "bfloat16 weights, f32 activations and accumulation",
        "num_sequences": len(windows),
        "length": FLAGS.length,
        "positions": int(same.size),
        "greedy_tokens": FLAGS.greedy_tokens,
        "result": result,
        "seconds": time.perf_counter() - start,
    }
    lines = [
        f"bf16 weights vs f32 weights on {model_name} (f32 activations and KV): {len(windows)} windows of "
        f"{FLAGS.length} tokens ({same.size} positions), half natural text, half generated answers; greedy: "
        f"{FLAGS.greedy_tokens} tokens after the first {half}.",
        "",
        f"| weights | {kv_quality.TABLE_COLUMNS}",
        "|---|---:|---:|---:|---:|---:|---:|",
        kv_quality.table_row("bfloat16", result),
    ]
    kv_quality.write_report(FLAGS.out, report, lines)


if __name__ == "__main__":
    app.run(main)
