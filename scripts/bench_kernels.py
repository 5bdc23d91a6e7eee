"""Paged-attention kernel benchmark: decode bandwidth and mixed-batch TFLOP/s, Pallas vs the XLA reference.

    python scripts/bench_kernels.py [--preset full|small] [--impls pallas,xla] [--out bench_results/kernels]

Decode: every sequence adds one token at the same context length; reported as bytes of KV read
per second against the device-to-device copy bandwidth measured in the same run (x + 1 over a
large array, counting its read and its write). Mixed: prefill chunks over history plus decodes
in one ragged batch, reported as attention TFLOP/s (4 * query heads * head_dim per visible KV
token). The KV write (the XLA scatter every implementation uses) is timed for a decode step
and a prefill chunk. Each Pallas configuration of a small sweep is timed and the best is kept.

Needs only jax and numpy (no absl), so it runs on a bare accelerator image. On CPU the Pallas
kernels have no native lowering, so `--impls` defaults to xla there and the preset to small.
Writes <out>.json and <out>.md and prints the table last.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (  # noqa: E402
    AttentionMetadata,
    QuantizedKVPages,
    page_bytes,
    paged_attention_gpu,
    quantize_per_row,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    write_kv,
)

PRESETS = {
    # The decode shape; a mixed batch of 4 prefill chunks of 512 over 1,536 history plus 60 decodes.
    "full": dict(batch=64, context=4096, prefills=4, chunk=512, history=1536, copy_mib=1024),
    "small": dict(batch=8, context=512, prefills=2, chunk=128, history=128, copy_mib=128),
}
# Pallas tilings tried per workload: (queries_per_block, pages_per_block, num_warps); None = the default.
GPU_SWEEP = [(None, None, 4), (1, 4, 4), (1, 16, 4), (1, 8, 8), (4, 8, 4), (8, 8, 4), (16, 8, 8)]
TPU_SWEEP = [(None, None, None), (None, 16, None), (None, 32, None), (2, 8, None)]


def timed(fn, *args, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds of fn(*args) after warm-up calls (which also compile)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(mib: int) -> float:
    """Device-to-device copy bandwidth in bytes/s: x + 1 reads and writes every byte once."""
    x = jnp.zeros((mib * 2**20 // 2,), jnp.bfloat16)
    seconds = timed(jax.jit(lambda x: x + 1), x, iters=20)
    return 2 * x.nbytes / seconds


def make_pool(key, num_pages, page_size, num_kv_heads, head_dim, kv_dtype):
    """A random pool on the device: bf16 pages, or 8-bit pages quantized per token and head."""
    values = jax.random.normal(key, (num_pages, page_size, 2 * num_kv_heads, head_dim), jnp.bfloat16)
    if kv_dtype == "bfloat16":
        return values.reshape(num_pages, page_size, -1)
    pages, scales = jax.jit(quantize_per_row, static_argnums=1)(values, jnp.dtype(kv_dtype))
    return QuantizedKVPages.from_values(pages, scales)


def make_batch(kv_lens, q_lens, page_size, num_pages, seed=0) -> AttentionMetadata:
    """Metadata of sequences in random, non-contiguous pages (attention only: slots unused)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-n // page_size) for n in kv_lens)
    needed = sum(-(-n // page_size) for n in kv_lens)
    order = rng.permutation(np.arange(1, num_pages))[:needed]
    tables = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    used = 0
    for s, kv_len in enumerate(kv_lens):
        count = -(-kv_len // page_size)
        tables[s, :count] = order[used : used + count]
        used += count
    return AttentionMetadata(
        slots=jnp.zeros((padded_tokens(q_lens),), jnp.int32),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        num_seqs=jnp.asarray([len(kv_lens)], jnp.int32),
    )


def padded_tokens(q_lens) -> int:
    """Tokens padded to a power of two, as the engine's step pads them."""
    return 1 << (sum(q_lens) - 1).bit_length()


def attention_flops(kv_lens, q_lens, num_q_heads, head_dim) -> float:
    """QK and PV flops of causal attention: each new token sees its position + 1 keys."""
    visible = sum(sum(range(kv - q + 1, kv + 1)) for kv, q in zip(kv_lens, q_lens, strict=True))
    return 4.0 * num_q_heads * head_dim * visible


def kv_bytes_read(kv_lens, num_kv_heads, head_dim, kv_dtype, page_size) -> float:
    """Bytes of K, V (and 8-bit scale rows) a decode step must read: every page it holds tokens in, once."""
    pages = sum(-(-n // page_size) for n in kv_lens)
    return float(pages * page_bytes(page_size, num_kv_heads, head_dim, kv_dtype))


def pallas_impls(backend: str, sm_scale: float):
    """(config label, function) for each tiling of the backend's Pallas kernel."""
    if backend == "gpu":
        for qpb, ppb, warps in GPU_SWEEP:
            options = dict(queries_per_block=qpb, pages_per_block=ppb, num_warps=warps)
            yield (
                f"q{qpb or 'auto'}/p{ppb or 'auto'}/w{warps}",
                lambda q, kv, m, o=options: paged_attention_gpu(q, kv, m, sm_scale=sm_scale, **o),
            )
    elif backend == "tpu":
        for qpb, ppb, _ in TPU_SWEEP:
            options = dict(queries_per_block=qpb, pages_per_block=ppb)
            yield (
                f"q{qpb or 'auto'}/p{ppb or 'auto'}",
                lambda q, kv, m, o=options: ragged_paged_attention_tpu(q, kv, m, sm_scale=sm_scale, **o),
            )


def run_workload(name, kv_lens, q_lens, args, pool, kv_dtype, impls, copy_bw) -> list[dict]:
    """Time every implementation on one batch; return one row per implementation (best Pallas tiling)."""
    num_pages = pool.shape[0]
    metadata = make_batch(kv_lens, q_lens, args.page_size, num_pages)
    q = jax.random.normal(jax.random.key(1), (padded_tokens(q_lens), args.num_q_heads, args.head_dim), jnp.bfloat16)
    sm_scale = args.head_dim**-0.5
    flops = attention_flops(kv_lens, q_lens, args.num_q_heads, args.head_dim)
    kv_bytes = kv_bytes_read(kv_lens, args.num_kv_heads, args.head_dim, kv_dtype, args.page_size)
    reference = jax.jit(lambda q, kv, m: ragged_paged_attention_reference(q, kv, m, sm_scale=sm_scale))
    candidates = {"xla": [("per_block", reference)]} if "xla" in impls else {}
    if "pallas" in impls:
        candidates["pallas"] = [(label, jax.jit(fn)) for label, fn in pallas_impls(jax.default_backend(), sm_scale)]
    rows, expected = [], None
    for impl, configs in candidates.items():
        tried = []
        for label, fn in configs:
            try:
                out = jax.block_until_ready(fn(q, pool, metadata))
                seconds = timed(fn, q, pool, metadata, iters=args.iters)
            except Exception as error:  # one tiling failing to compile must not sink the sweep
                tried.append({"config": label, "error": f"{type(error).__name__}: {str(error)[:300]}"})
                continue
            if expected is None:
                expected = np.asarray(out, np.float32)
            agreement = float(np.linalg.norm(np.asarray(out, np.float32) - expected) / np.linalg.norm(expected))
            tried.append({"config": label, "seconds": seconds, "rel_diff_vs_first": agreement})
        timed_configs = [t for t in tried if "seconds" in t]
        if not timed_configs:
            rows.append({"workload": name, "kv_dtype": kv_dtype, "impl": impl, "sweep": tried})
            continue
        best = min(timed_configs, key=lambda t: t["seconds"])
        rows.append(
            {
                "workload": name,
                "kv_dtype": kv_dtype,
                "impl": impl,
                "config": best["config"],
                "ms": best["seconds"] * 1e3,
                "kv_gb_per_s": kv_bytes / best["seconds"] / 1e9,
                "fraction_of_copy_bw": kv_bytes / best["seconds"] / copy_bw,
                "tflop_per_s": flops / best["seconds"] / 1e12,
                "rel_diff_vs_first": best["rel_diff_vs_first"],
                "sweep": tried,
            }
        )
    by_impl = {row["impl"]: row for row in rows if "ms" in row}
    if "xla" in by_impl:
        for row in by_impl.values():
            row["speedup_vs_xla"] = by_impl["xla"]["ms"] / row["ms"]
    return rows


def time_kv_write(pool, num_tokens, args, kv_dtype) -> tuple[dict, object]:
    """The XLA scatter of one step's K/V (quantizing for FP8) into the donated pool; returns the row and the pool."""
    num_pages = pool.shape[0]
    rng = np.random.default_rng(2)
    slots = jnp.asarray(rng.choice(np.arange(args.page_size, num_pages * args.page_size), num_tokens, replace=False))
    k = jax.random.normal(jax.random.key(3), (num_tokens, args.num_kv_heads, args.head_dim), jnp.bfloat16)
    write = jax.jit(write_kv, donate_argnums=0)
    state = {"pool": pool}

    def step():
        state["pool"] = write(state["pool"], k, k, slots)
        return state["pool"]

    seconds = timed(step, iters=args.iters)
    row = {"workload": f"kv write {num_tokens} tokens", "kv_dtype": kv_dtype, "impl": "xla scatter"}
    return {**row, "ms": seconds * 1e3}, state["pool"]


def markdown(result: dict) -> str:
    """The results as a markdown table."""
    lines = [
        f"Kernel benchmark on {result['device']} (jax {result['jax']}), copy bandwidth "
        f"{result['copy_gb_per_s']:.0f} GB/s measured in the same run.",
        "",
        "| workload | KV dtype | impl | tiling | ms | KV GB/s | % of copy BW | TFLOP/s | x XLA |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "ms" not in row:
            lines.append(f"| {row['workload']} | {row['kv_dtype']} | {row['impl']} | all tilings failed | | | | | |")
            continue
        cells = [
            row["workload"],
            row["kv_dtype"],
            row["impl"],
            row.get("config", ""),
            f"{row['ms']:.3f}",
            f"{row['kv_gb_per_s']:.3g}" if "kv_gb_per_s" in row else "",
            f"{100 * row['fraction_of_copy_bw']:.0f}%" if "fraction_of_copy_bw" in row else "",
            f"{row['tflop_per_s']:.3g}" if "tflop_per_s" in row else "",
            f"{row['speedup_vs_xla']:.1f}" if "speedup_vs_xla" in row else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    backend = jax.default_backend()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small" if backend == "cpu" else "full")
    parser.add_argument("--impls", default="xla" if backend == "cpu" else "pallas,xla")
    parser.add_argument("--kv_dtypes", default="bfloat16,float8_e4m3fn,int8")
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--num_kv_heads", type=int, default=8)
    parser.add_argument("--num_q_heads", type=int, default=32)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench_results/kernels")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    impls = set(args.impls.split(","))
    if "pallas" in impls and backend == "cpu":
        parser.error("the Pallas kernels have no native CPU lowering; use --impls xla on CPU")

    copy_bw = copy_bandwidth(preset["copy_mib"])
    batch, context = preset["batch"], preset["context"]
    decode = ([context] * batch, [1] * batch)
    num_decodes = batch - preset["prefills"]
    mixed = (
        [preset["history"] + preset["chunk"]] * preset["prefills"] + [context] * num_decodes,
        [preset["chunk"]] * preset["prefills"] + [1] * num_decodes,
    )
    num_pages = 1 + sum(-(-n // args.page_size) for n in decode[0]) + 8
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        pool = make_pool(jax.random.key(0), num_pages, args.page_size, args.num_kv_heads, args.head_dim, kv_dtype)
        rows += run_workload(f"decode {batch}x{context}", *decode, args, pool, kv_dtype, impls, copy_bw)
        label = f"mixed {preset['prefills']}x{preset['chunk']}+{num_decodes} decodes"
        rows += run_workload(label, *mixed, args, pool, kv_dtype, impls, copy_bw)
        for num_tokens in (batch, preset["chunk"] * preset["prefills"]):
            row, pool = time_kv_write(pool, num_tokens, args, kv_dtype)
            rows.append(row)
        del pool
    result = {
        "device": jax.devices()[0].device_kind,
        "backend": backend,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "shape": dict(
            page_size=args.page_size,
            num_kv_heads=args.num_kv_heads,
            num_q_heads=args.num_q_heads,
            head_dim=args.head_dim,
        ),
        "copy_gb_per_s": copy_bw / 1e9,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    table = markdown(result)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
