"""Compile the attention kernels and the engine step for real TPUs and GPUs on a machine without one.

    python scripts/aot_compile.py --target tpu-v5e --model smollm2 --mesh data=1,model=1
    python scripts/aot_compile.py --target tpu-v6e --model llama3-8b --mesh data=1,model=8
    python scripts/aot_compile.py --target tpu-v5e --kernels ci|covering|full [--jobs 2]
    python scripts/aot_compile.py --target gpu-sm90 --kernels ci|covering|full

--model compiles the engine step (its forward, with the KV write, and its sampling: what Engine runs) with libtpu's
compiler for every (T, S) bucket the budgets allow (--buckets largest for the largest one alone), from
shapes alone, and prints a table per program: compile status and seconds, argument, output and temp bytes
per chip against the chip's HBM, and XLA's flop and byte counts. A program that does not fit says so.
--model takes smollm2 (the embedded model's config), llama3-8b, a config.json, an HF folder or a .gguf.

--kernels compiles one attention call per case of a matrix: Mosaic for TPU cases (each worker process
compiles cases in turn; a case that aborts libtpu is reported and the rest go on in a new process), or
pip triton plus ptxas for sm_90 (registers, spills, shared memory). `ci` is the representative subset the
tests compile, `covering` meets every value of every axis, `full` is the whole product.

Writes --json when given, and prints markdown tables. Exits 1 if any case failed or a step does not fit.
"""

import argparse
import dataclasses
import itertools
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; run nothing here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import AttentionMetadata, QuantizedKVPages, deviceless  # noqa: E402
from pallas_kernels.quantization import scale_lanes  # noqa: E402

# Tokens and sequence rows of each batch kind; decode batches are decode-shaped (T <= S).
BATCH_SHAPES = {"decode": (64, 64), "prefill": (512, 8), "mixed": (256, 32)}
CONTEXT = 4096  # block-table width in tokens
NUM_PAGES = 2048
KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "int8")
# Limits a GPU case must meet (the hardware-kernels issue): decode never spills; mixed and prefill spill at
# most this many bytes per thread; shared memory within the target's.
MAX_MIXED_SPILL_BYTES = 256


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One attention call to compile: which kernel, batch kind, page dtype and head geometry."""

    kernel: str  # "tpu" or "gpu"
    kind: str  # decode | prefill | mixed
    kv_dtype: str
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    page_size: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.kv_dtype} K={self.num_kv_heads} G={self.group} D={self.head_dim} P={self.page_size}"


def kernel_cases(kernel: str, which: str) -> list[KernelCase]:
    """The matrix of cases for one kernel: `ci`, `covering` or `full`."""
    if kernel == "gpu":
        return _gpu_cases(which)
    axes = dict(
        kind=("decode", "prefill", "mixed"),
        kv_dtype=KV_DTYPES,
        num_kv_heads=(1, 2, 3, 8),
        group=tuple(range(1, 9)),
        head_dim=(64, 128, 256),
        page_size=(16, 32, 64, 128),
    )
    if which == "full":
        return [KernelCase("tpu", *values) for values in itertools.product(*axes.values())]
    # Every (page size, head_dim, dtype) triple once, the other axes turning through their values, so every
    # value of every axis meets every value of those three.
    cases = []
    for index, (page_size, head_dim, kv_dtype) in enumerate(
        itertools.product(axes["page_size"], axes["head_dim"], axes["kv_dtype"])
    ):
        kind = axes["kind"][index % 3]
        heads = axes["num_kv_heads"][index % 4]
        group = axes["group"][(index * 3) % 8]
        cases.append(KernelCase("tpu", kind, kv_dtype, heads, group, head_dim, page_size))
    if which == "covering":
        return cases
    # ci: the models' own shapes in every dtype and batch kind, plus the covering set's odd corners.
    ci = [KernelCase("tpu", kind, dtype, 8, 4, 128, 16) for kind in axes["kind"] for dtype in KV_DTYPES]  # Llama-3-8B
    ci += [KernelCase("tpu", kind, dtype, 3, 3, 64, 16) for kind in axes["kind"] for dtype in KV_DTYPES]  # SmolLM2
    ci += [
        KernelCase("tpu", "mixed", "int8", 1, 8, 256, 128),
        KernelCase("tpu", "decode", "float8_e4m3fn", 2, 5, 256, 32),
        KernelCase("tpu", "prefill", "bfloat16", 1, 7, 128, 64),
        KernelCase("tpu", "mixed", "float32", 2, 6, 64, 128),
        KernelCase("tpu", "decode", "float8_e5m2", 8, 1, 64, 64),
        KernelCase("tpu", "prefill", "int8", 3, 2, 128, 32),
        # Many KV heads (MHA, Llama-2-7B's 32): programs of 8 heads, lane-aligned slices of each page.
        KernelCase("tpu", "decode", "int8", 16, 1, 128, 16),
        KernelCase("tpu", "prefill", "bfloat16", 32, 1, 128, 16),
    ]
    return ci


def _gpu_cases(which: str) -> list[KernelCase]:
    kinds, dtypes = ("decode", "mixed", "prefill"), ("bfloat16", "float8_e4m3fn", "int8")
    shapes = [(8, 4, 128, 16), (3, 3, 64, 16)]  # Llama-3-8B, SmolLM2
    if which in ("covering", "full"):
        shapes += [(1, 8, 128, 32), (2, 1, 64, 64), (8, 8, 256, 16), (4, 2, 128, 128)]
    if which == "full":
        # f32 queries make Triton's dot exact f32 FMA, which spills at these tiles (BUILD.md): not a GPU target.
        dtypes += ("float8_e5m2",)
    return [KernelCase("gpu", kind, dtype, *shape) for kind in kinds for dtype in dtypes for shape in shapes]


def case_inputs(case: KernelCase, sharding=None):
    """ShapeDtypeStructs of one call: q, the pool (plain or 8-bit with scales) and the batch metadata."""

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    num_tokens, num_seqs = BATCH_SHAPES[case.kind]
    width = 2 * case.num_kv_heads * case.head_dim
    q_dtype = jnp.float32 if case.kv_dtype == "float32" else jnp.bfloat16
    q = abstract((num_tokens, case.num_kv_heads * case.group, case.head_dim), q_dtype)
    if case.kv_dtype in ("bfloat16", "float32"):
        pool = abstract((NUM_PAGES, case.page_size, width), jnp.dtype(case.kv_dtype))
    else:
        lanes = scale_lanes(case.num_kv_heads, case.page_size)
        pool = QuantizedKVPages(
            abstract((NUM_PAGES, case.page_size, width), jnp.uint8),
            abstract((NUM_PAGES, 1, lanes), jnp.uint32),
            case.kv_dtype,
            case.head_dim,
        )
    pages_per_seq = CONTEXT // case.page_size
    metadata = AttentionMetadata(
        slots=abstract((num_tokens,), jnp.int32),
        block_tables=abstract((num_seqs, pages_per_seq), jnp.int32),
        cu_q_lens=abstract((num_seqs + 1,), jnp.int32),
        kv_lens=abstract((num_seqs,), jnp.int32),
        num_seqs=abstract((1,), jnp.int32),
    )
    return q, pool, metadata


def _tile(case: KernelCase, q, pool, metadata) -> str:
    """The tiling the kernel chooses for the case, as text."""
    from pallas_kernels.paged_attention_gpu import gpu_layout
    from pallas_kernels.ragged_paged_attention_tpu import tpu_layout

    quantized = isinstance(pool, QuantizedKVPages)
    values = pool.pages if quantized else pool
    options = dict(sm_scale=0.1, sliding_window=None, soft_cap=None, queries_per_block=None, pages_per_block=None)
    if case.kernel == "tpu":
        layout = tpu_layout(q, values, metadata, quantized=quantized, **options)
    else:
        layout = gpu_layout(q, values, metadata, **options)
    heads = layout.heads_per_block if case.kernel == "tpu" else 1
    return (
        f"{layout.rows}x{layout.block_tokens} ({layout.queries_per_block} tok x {layout.group} heads; "
        f"{heads} KV heads/program)"
    )


def _vmem(q, pool, metadata) -> int:
    """The TPU kernel's VMEM buffers for the case, in bytes (its own estimate; it asks for twice that, >= 32 MiB)."""
    from pallas_kernels.ragged_paged_attention_tpu import _vmem_estimate, tpu_layout

    quantized = isinstance(pool, QuantizedKVPages)
    values = pool.pages if quantized else pool
    options = dict(sm_scale=0.1, sliding_window=None, soft_cap=None, queries_per_block=None, pages_per_block=None)
    layout = tpu_layout(q, values, metadata, quantized=quantized, **options)
    scale_window = pool.scales.shape[-1] // layout.num_head_blocks if quantized else 0
    return _vmem_estimate(layout, q.dtype, values.dtype, scale_window)


def compile_tpu_case(case: KernelCase, mesh) -> dict:
    """Compile one TPU case with Mosaic; the result row."""
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels import ragged_paged_attention_tpu

    inputs = case_inputs(case, NamedSharding(mesh, PartitionSpec()))
    start = time.perf_counter()
    row = dict(case=dataclasses.asdict(case), label=case.label, tile=_tile(case, *inputs), vmem=_vmem(*inputs))
    try:
        with jax.set_mesh(mesh):
            fn = jax.jit(lambda q, kv, m: ragged_paged_attention_tpu(q, kv, m, sm_scale=case.head_dim**-0.5))
            fn.trace(*inputs).lower().compile()
        row.update(status="ok")
    except Exception as e:  # the compiler's message is the finding
        row.update(status="error", message=" ".join(str(e).split())[:400])
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def compile_gpu_case(case: KernelCase, gpu: deviceless.Target) -> dict:
    """Lower one GPU case for cuda and compile its Triton kernel for the target; the result row with ptxas' report."""
    from pallas_kernels import paged_attention_gpu

    inputs = case_inputs(case)
    start = time.perf_counter()
    row = dict(case=dataclasses.asdict(case), label=case.label, tile=_tile(case, *inputs))
    try:
        fn = jax.jit(lambda q, kv, m: paged_attention_gpu(q, kv, m, sm_scale=case.head_dim**-0.5))
        (kernel,) = deviceless.triton_kernels(fn.trace(*inputs).lower(lowering_platforms=("cuda",)))
        report = deviceless.compile_triton(kernel, gpu)
        row.update(dataclasses.asdict(report), num_warps=kernel.num_warps, num_stages=kernel.num_stages)
        limit = 0 if case.kind == "decode" else MAX_MIXED_SPILL_BYTES
        problems = []
        if report.spill_stores > limit:
            problems.append(f"spills {report.spill_stores} B/thread (limit {limit})")
        if report.shared_bytes > gpu.shared_memory_bytes:
            problems.append(f"needs {report.shared_bytes} B of shared memory (limit {gpu.shared_memory_bytes})")
        row.update(status="over limits" if problems else "ok", message="; ".join(problems))
    except Exception as e:
        row.update(status="error", message=" ".join(str(e).split())[:400])
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def worker(target_name: str) -> None:
    """Compile the TPU cases read from stdin (one JSON object a line), printing one result line each."""
    tpu = deviceless.target(target_name)
    mesh = jax.sharding.Mesh(deviceless.tpu_devices(tpu)[:1], ("model",))
    for line in sys.stdin:
        case = KernelCase(**json.loads(line))
        print(json.dumps(compile_tpu_case(case, mesh)), flush=True)


def run_tpu_cases(cases: list[KernelCase], target_name: str, jobs: int) -> list[dict]:
    """Compile TPU cases in `jobs` worker processes; a case that kills its worker is reported and skipped."""
    pending: queue.Queue = queue.Queue()
    for index, case in enumerate(cases):
        pending.put((index, case))
    results: dict[int, dict] = {}
    lock = threading.Lock()

    def drive():
        while True:
            try:
                index, case = pending.get_nowait()
            except queue.Empty:
                return
            process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", f"--target={target_name}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            stderr_lines: list[str] = []
            threading.Thread(target=stderr_lines.extend, args=(process.stderr,), daemon=True).start()
            current = (index, case)
            while current is not None:
                process.stdin.write(json.dumps(dataclasses.asdict(current[1])) + "\n")
                process.stdin.flush()
                line = process.stdout.readline()
                if not line:  # the compiler aborted the process
                    process.wait()
                    fatal = [s.strip() for s in stderr_lines if "Check failed" in s or "F1" in s[:3]]
                    with lock:
                        results[current[0]] = dict(
                            case=dataclasses.asdict(current[1]),
                            label=current[1].label,
                            status="aborted",
                            message=(fatal or [s.strip() for s in stderr_lines[-1:]] or ["no output"])[0][:400],
                        )
                    break
                with lock:
                    results[current[0]] = json.loads(line)
                try:
                    current = pending.get_nowait()
                except queue.Empty:
                    current = None
            if current is None:
                process.stdin.close()
                process.wait()

    threads = [threading.Thread(target=drive) for _ in range(max(1, jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(cases))]


def model_config(name: str):
    """The ModelConfig for --model: smollm2, llama3-8b, or a path the planner reads."""
    import models
    from paxkv.entrypoints.planner import plan_model_config
    from paxkv.execution.aot import LLAMA_3_8B

    if name == "llama3-8b":
        return models.ModelConfig.from_hf_config(LLAMA_3_8B)
    return plan_model_config(None if name == "smollm2" else name)


def run_step_programs(args, tpu: deviceless.Target) -> tuple[list[dict], dict]:
    """Compile the engine step (forward and sampling) on the target's mesh; a row per (T, S) bucket, and the setup."""
    from paxkv.entrypoints.config_flags import parse_memory_size
    from paxkv.execution import aot
    from paxkv.parallel.mesh import make_mesh, parse_mesh_shape

    config = model_config(args.model)
    if args.num_layers:
        config = dataclasses.replace(config, num_layers=args.num_layers)
    sizes = parse_mesh_shape(args.mesh)
    devices = deviceless.tpu_devices(tpu)
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise SystemExit(f"--mesh {args.mesh} needs {needed} chips; the {tpu.topology} topology has {len(devices)}")
    mesh = make_mesh(args.mesh, devices[:needed])
    memory = parse_memory_size(args.kv_cache_memory)
    num_pages = aot.pages_for_memory(config, memory, args.page_size, args.kv_cache_dtype, args.dtype, mesh)
    num_pages -= num_pages % sizes["data"]
    max_model_len = min(args.max_model_len, config.max_position_embeddings)
    engine = aot.abstract_engine(
        config,
        mesh,
        num_pages=num_pages,
        page_size=args.page_size,
        max_model_len=max_model_len,
        dtype=args.dtype,
        compute_dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_impl="pallas_tpu",
    )
    padding = aot.StepPadding.for_platform(tpu.platform, args.min_padded_seqs, args.min_padded_tokens)
    buckets = aot.step_buckets(args.max_num_batched_tokens, args.max_num_seqs, padding)
    buckets = buckets[-1:] if args.buckets == "largest" else buckets
    rows = []
    for num_tokens, num_seqs in buckets:
        row = dict(num_tokens=num_tokens, num_seqs=num_seqs)
        try:
            program = aot.compile_step(engine, num_tokens, num_seqs, with_logprobs=args.logprobs)
        except Exception as e:
            message = " ".join(str(e).split())[:400]
            # libtpu itself refuses a program whose buffers exceed the chip's HBM.
            status = "does not fit" if "RESOURCE_EXHAUSTED" in message else "error"
            row.update(status=status, message=message)
            if status == "error":
                traceback.print_exc()
        else:
            memory_row = dataclasses.asdict(program.memory)
            fits = program.memory.total_bytes <= tpu.memory_bytes
            row.update(
                status="ok" if fits else "does not fit",
                seconds=round(program.compile_seconds, 1),
                total_bytes=program.memory.total_bytes,
                flops=program.flops,
                bytes_accessed=program.bytes_accessed,
                **memory_row,
            )
        rows.append(row)
        print(_step_line(row, tpu), flush=True)
    setup = dict(
        model=args.model,
        model_type=config.model_type,
        layers=config.num_layers if not args.num_layers else args.num_layers,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        mesh=args.mesh,
        chips=needed,
        num_pages=num_pages,
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        hbm_bytes=tpu.memory_bytes,
    )
    return rows, setup


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _step_line(row: dict, tpu: deviceless.Target) -> str:
    if "message" in row:
        return f"| {row['num_tokens']} | {row['num_seqs']} | {row['status']}: {row['message'][:160]} | | | | | | | |"
    return (
        f"| {row['num_tokens']} | {row['num_seqs']} | {row['status']} | {row['seconds']} | "
        f"{_gib(row['argument_bytes'])} | {_gib(row['output_bytes'] - row['alias_bytes'])} | "
        f"{row['temp_bytes'] / 2**20:.1f} | {_gib(row['total_bytes'])} / {_gib(tpu.memory_bytes)} | "
        f"{row['flops'] / 1e9:.1f} | {row['bytes_accessed'] / 2**30:.2f} |"
    )


STEP_HEADER = (
    "| T | S | status | compile s | arguments GiB | outputs GiB (not aliased) | temp MiB | total / HBM GiB | "
    "GFLOP | GiB accessed |\n|---|---|---|---|---|---|---|---|---|---|"
)


def kernel_table(rows: list[dict], kernel: str) -> str:
    """Markdown table of kernel cases."""
    if kernel == "tpu":
        lines = [
            "| case | tile (rows x KV tokens) | VMEM buffers KiB | status | seconds | message |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            vmem = f"{r['vmem'] / 1024:.0f}" if "vmem" in r else ""
            lines.append(
                f"| {r['label']} | {r.get('tile', '')} | {vmem} | {r['status']} | {r.get('seconds', '')} | "
                f"{r.get('message', '')[:160]} |"
            )
        return "\n".join(lines)
    lines = [
        "| case | tile (rows x KV tokens) | warps | registers | spill stores B | spill loads B | shared KiB | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "error":
            lines.append(f"| {r['label']} | {r.get('tile', '')} | | | | | | error: {r['message'][:120]} |")
            continue
        lines.append(
            f"| {r['label']} | {r['tile']} | {r['num_warps']} | {r['registers']} | {r['spill_stores']} | "
            f"{r['spill_loads']} | {r['shared_bytes'] / 1024:.1f} | {r['status']} {r.get('message', '')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, choices=sorted(deviceless.TARGETS))
    parser.add_argument("--model", help="smollm2 | llama3-8b | a config.json, HF folder or .gguf")
    parser.add_argument("--mesh", default="data=1,model=1")
    parser.add_argument("--kernels", choices=("ci", "covering", "full"))
    parser.add_argument("--jobs", type=int, default=2, help="TPU kernel cases compiled in parallel processes")
    parser.add_argument("--kv_cache_memory", default="4GiB", help="the whole pool, over every chip's shard")
    parser.add_argument("--kv_cache_dtype", default="auto")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--max_num_batched_tokens", type=int, default=512)
    parser.add_argument("--max_num_seqs", type=int, default=32)
    parser.add_argument("--min_padded_seqs", type=int, help="the smallest S bucket (default: TPU's, 8)")
    parser.add_argument("--min_padded_tokens", type=int, help="the smallest T bucket (default 1)")
    parser.add_argument("--max_model_len", type=int, default=4096)
    parser.add_argument("--buckets", choices=("all", "largest"), default="all")
    parser.add_argument("--logprobs", action="store_true", help="compile the logprobs variant of each step")
    parser.add_argument("--num_layers", type=int, help="keep this many of the model's layers (quicker checks)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.target)
        return 0
    chip = deviceless.target(args.target)
    if (args.model is None) == (args.kernels is None):
        parser.error("give one of --model (the engine step) or --kernels (attention kernel cases)")
    if args.model is not None and chip.platform != "tpu":
        parser.error("--model compiles the whole step, which needs a TPU target; use --kernels for gpu-sm90")
    result = dict(target=args.target, jax=jax.__version__)
    if args.kernels is not None:
        kernel = "tpu" if chip.platform == "tpu" else "gpu"
        cases = kernel_cases(kernel, args.kernels)
        print(f"compiling {len(cases)} {kernel} kernel cases ({args.kernels}) for {args.target}", flush=True)
        start = time.perf_counter()
        if kernel == "tpu":
            rows = run_tpu_cases(cases, args.target, args.jobs)
        else:
            rows = [compile_gpu_case(case, chip) for case in cases]
        result.update(kernels=args.kernels, rows=rows, seconds=round(time.perf_counter() - start, 1))
        if kernel == "gpu":
            import triton

            result["triton"] = triton.__version__
        print(kernel_table(rows, kernel))
        failed = [r for r in rows if r["status"] != "ok"]
        print(f"{len(rows) - len(failed)} of {len(rows)} cases ok in {result['seconds']} s")
    else:
        print(STEP_HEADER, flush=True)
        rows, setup = run_step_programs(args, chip)
        result.update(setup=setup, steps=rows)
        failed = [r for r in rows if r["status"] != "ok"]
        print(
            f"{args.model} on {args.target} mesh {args.mesh}: {len(rows) - len(failed)} of {len(rows)} step "
            f"programs compile and fit in {_gib(chip.memory_bytes)} GiB per chip ({setup['num_pages']} pages)"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
