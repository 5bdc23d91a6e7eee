"""Compile the attention kernels and the engine step for real TPUs and GPUs on a machine without one.

    python scripts/aot_compile.py --target tpu-v5e --model smollm2 --mesh data=1,model=1
    python scripts/aot_compile.py --target tpu-v6e --model llama3-8b --mesh data=1,model=8
    python scripts/aot_compile.py --target tpu-v5e --kernels ci|covering|full [--jobs 2]
    python scripts/aot_compile.py --target gpu-sm90 --kernels ci|covering|full

--model compiles the engine step (its forward, with the KV write, and its sampling: what Engine runs) with libtpu's
compiler for every (T, S) bucket the budgets allow (--buckets largest for the largest one alone), from
shapes alone, and the chained decode program (--num_scheduler_steps passes in one loop, as Engine chains them) for
each of those S buckets. It prints a table per program: compile status and seconds, argument, output and temp bytes
per chip against the chip's HBM, and XLA's flop and byte counts. A program that does not fit says so.
--model takes smollm2 (the embedded model's config), llama3-8b, a config.json, an HF folder or a .gguf.

--kernels compiles one attention call per case of a matrix: Mosaic for TPU cases (each worker process
compiles --group cases to a program, which pays the program's own compile once; a group that fails is compiled
again case by case, and a case that aborts libtpu is reported and the rest go on in a new process), or
pip triton plus ptxas for sm_90 (registers, spills, shared memory). `ci` is the representative subset the
tests compile, `covering` meets every value of every axis, `full` is the whole product.

Writes --json when given, and prints markdown tables. Exits 1 if any case failed or a step does not fit.
"""

import argparse
import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; run nothing here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
from kernel_matrix import KernelCase, case_inputs, case_tile, case_vmem_bytes, kernel_cases  # noqa: E402

from pallas_kernels import deviceless  # noqa: E402

# Limits a GPU case must meet (the hardware-kernels issue): decode never spills; mixed and prefill spill at
# most this many bytes per thread; shared memory within the target's.
MAX_MIXED_SPILL_BYTES = 256


def compile_tpu_cases(cases: list[KernelCase], mesh) -> list[dict]:
    """Compile TPU cases with Mosaic as one program (each kernel compiled in full, the program's own compile paid
    once); one row each. If the program fails, each case is compiled alone, so every error names its case."""
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels import ragged_paged_attention_tpu

    inputs = [case_inputs(case, NamedSharding(mesh, PartitionSpec())) for case in cases]
    rows = [
        dict(case=dataclasses.asdict(case), label=case.label, tile=case_tile(case, *args), vmem=case_vmem_bytes(*args))
        for case, args in zip(cases, inputs, strict=True)
    ]

    def program(*all_inputs):
        return tuple(
            ragged_paged_attention_tpu(q, kv, m, sm_scale=case.head_dim**-0.5)
            for case, (q, kv, m) in zip(cases, all_inputs, strict=True)
        )

    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            jax.jit(program).trace(*inputs).lower().compile()
    except Exception as e:  # the compiler's message is the finding
        if len(cases) > 1:
            return [row for case in cases for row in compile_tpu_cases([case], mesh)]
        rows[0].update(status="error", message=" ".join(str(e).split())[:400])
    else:
        for row in rows:
            row.update(status="ok")
    for row in rows:  # a group's time, shared evenly
        row.update(seconds=round((time.perf_counter() - start) / len(cases), 2), compiled_with=len(cases))
    return rows


def compile_gpu_case(case: KernelCase, gpu: deviceless.Target) -> dict:
    """Lower one GPU case for cuda and compile its Triton kernel for the target; the result row with ptxas' report."""
    from pallas_kernels import paged_attention_gpu

    inputs = case_inputs(case)
    start = time.perf_counter()
    row = dict(case=dataclasses.asdict(case), label=case.label, tile=case_tile(case, *inputs))
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
    """Compile groups of TPU cases read from stdin (a JSON list of cases a line), printing a list of rows each."""
    tpu = deviceless.target(target_name)
    mesh = jax.sharding.Mesh(deviceless.tpu_devices(tpu)[:1], ("model",))
    for line in sys.stdin:
        cases = [KernelCase(**case) for case in json.loads(line)]
        print(json.dumps(compile_tpu_cases(cases, mesh)), flush=True)


def run_tpu_cases(cases: list[KernelCase], target_name: str, jobs: int, group: int) -> list[dict]:
    """Compile TPU cases, `group` to a program, in `jobs` worker processes. A group that kills its worker is
    compiled again case by case in a new one; a case that kills it alone is reported and skipped."""
    pending: queue.Queue = queue.Queue()
    numbered = list(enumerate(cases))
    for start in range(0, len(numbered), group):
        pending.put(numbered[start : start + group])
    results: dict[int, dict] = {}
    lock = threading.Lock()

    def drive():
        while True:
            try:
                current = pending.get_nowait()
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
            while current is not None:
                process.stdin.write(json.dumps([dataclasses.asdict(case) for _, case in current]) + "\n")
                process.stdin.flush()
                line = process.stdout.readline()
                if not line:  # the compiler aborted the process
                    process.wait()
                    if len(current) > 1:
                        for one in current:
                            pending.put([one])
                        break
                    index, case = current[0]
                    fatal = [s.strip() for s in stderr_lines if "Check failed" in s or "F1" in s[:3]]
                    with lock:
                        results[index] = dict(
                            case=dataclasses.asdict(case),
                            label=case.label,
                            status="aborted",
                            message=(fatal or [s.strip() for s in stderr_lines[-1:]] or ["no output"])[0][:400],
                        )
                    break
                with lock:
                    results.update((index, row) for (index, _), row in zip(current, json.loads(line), strict=True))
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
    compile_plain = partial(aot.compile_step, engine, with_logprobs=args.logprobs)
    programs = [(dict(num_tokens=t, num_seqs=s, num_passes=1), partial(compile_plain, t, s)) for t, s in buckets]
    # The chained decode program (EngineConfig.num_scheduler_steps) for each row bucket the steps take.
    if (k := args.num_scheduler_steps) > 1:
        programs += [
            (dict(num_tokens=s, num_seqs=s, num_passes=k), partial(aot.compile_chained_step, engine, s, k))
            for s in sorted({s for _, s in buckets})
        ]
    rows = []
    for row, compile_program in programs:
        try:
            program = compile_program()
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
    tokens = row["num_tokens"] if row["num_passes"] == 1 else f"{row['num_tokens']} x {row['num_passes']} passes"
    if "message" in row:
        return f"| {tokens} | {row['num_seqs']} | {row['status']}: {row['message'][:160]} | | | | | | | |"
    return (
        f"| {tokens} | {row['num_seqs']} | {row['status']} | {row['seconds']} | "
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
            "| case | tile (rows x KV tokens) | VMEM buffers KiB | status | seconds (group's share) | message |",
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
    parser.add_argument("--group", type=int, default=8, help="TPU kernel cases compiled as one program")
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
    parser.add_argument(
        "--num_scheduler_steps", type=int, default=8, help="chained decode passes (1: no chained program)"
    )
    parser.add_argument("--num_layers", type=int, help="keep this many of the model's layers (quicker checks)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.num_scheduler_steps < 1:
        parser.error(
            f"--num_scheduler_steps must be at least 1 (1: no chained program); got {args.num_scheduler_steps}"
        )
    if args.worker:
        worker(args.target)
        return 0
    chip = deviceless.target(args.target)
    if (args.model is None) == (args.kernels is None):
        parser.error("give one of --model (the engine step) or --kernels (attention kernel cases)")
    if args.model is not None and chip.platform != "tpu":
        parser.error("--model compiles the whole step, which needs a TPU target; use --kernels for gpu-sm90")
    if args.group < 1:
        parser.error(f"--group={args.group}: compile at least 1 case to a program")
    result = dict(target=args.target, jax=jax.__version__)
    if args.kernels is not None:
        kernel = "tpu" if chip.platform == "tpu" else "gpu"
        cases = kernel_cases(kernel, args.kernels)
        print(f"compiling {len(cases)} {kernel} kernel cases ({args.kernels}) for {args.target}", flush=True)
        start = time.perf_counter()
        if kernel == "tpu":
            rows = run_tpu_cases(cases, args.target, args.jobs, args.group)
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
