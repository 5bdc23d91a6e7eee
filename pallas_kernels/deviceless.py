"""Compiling for a TPU or a GPU on a machine without one: the targets, libtpu topologies, and Triton reports.

TPU: libtpu's compiler (Mosaic for Pallas kernels, XLA for the rest) runs on any host once told which
chips it is compiling for. `tpu_devices` asks libtpu for a topology's devices; a mesh over them, passed
through `jax.set_mesh`, names the chip to the Pallas lowering and places every input, and
`jit(f).trace(*ShapeDtypeStructs).lower().compile()` then compiles from shapes alone.

GPU: lowering for "cuda" runs the Pallas Triton lowering and leaves each kernel's Triton IR (as MLIR
bytecode) in the custom call's backend config. The pip `triton` package compiles that IR to PTX and a
cubin, and its bundled ptxas reports registers and spills. pip triton is not XLA's own Triton fork, so its
figures stand in closely for what XLA would build, not exactly.

Some bad layouts abort libtpu's process instead of raising, so callers run each case in a process of its own.
"""

import dataclasses
import os
import re
import subprocess
import tempfile

import jax

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Target:
    """A chip to compile for."""

    name: str  # tpu-v5e, tpu-v6e, gpu-sm90
    platform: str  # "tpu" or "cuda"
    memory_bytes: int  # HBM per chip
    topology: str | None = None  # libtpu topology name (8 chips, so model=8 meshes fit)
    accelerator_type: str | None = None
    compute_capability: int | None = None  # GPU: 90 = sm_90
    shared_memory_bytes: int | None = None  # GPU: the most a block may use
    max_registers: int | None = None  # GPU: per thread


TARGETS = {
    "tpu-v5e": Target("tpu-v5e", "tpu", 16 * GIB, topology="v5e:2x4", accelerator_type="v5litepod-8"),
    "tpu-v6e": Target("tpu-v6e", "tpu", 32 * GIB, topology="v6e:2x4", accelerator_type="v6e-8"),
    # H200: 141 GB of HBM3e, 227 KiB of shared memory per block, 255 registers per thread.
    "gpu-sm90": Target(
        "gpu-sm90", "cuda", 141 * 10**9, compute_capability=90, shared_memory_bytes=227 * 1024, max_registers=255
    ),
}


def target(name: str) -> Target:
    """The target called `name`, or a ValueError listing the known ones."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {sorted(TARGETS)}")
    return TARGETS[name]


def prepare_tpu_environment(tpu: Target) -> None:
    """Tell libtpu there is no TPU to query and which chips it compiles for; before libtpu first loads.

    Several processes may load libtpu at once (ALLOW_MULTIPLE_LIBTPU_LOAD): compiling takes no device.
    """
    for name, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", tpu.accelerator_type),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_WORKER_ID", "0"),
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
        os.environ.setdefault(name, value)


def tpu_devices(tpu: Target) -> list:
    """The devices of the target's topology (compile-only: nothing runs on them)."""
    from jax.experimental import topologies

    prepare_tpu_environment(tpu)
    try:
        topology = topologies.get_topology_desc(topology_name=tpu.topology, platform="tpu")
    except Exception as e:  # libtpu missing, or too old for this chip
        raise RuntimeError(
            f"cannot get the {tpu.topology} TPU topology ({str(e).splitlines()[0][:200]}); install libtpu at the "
            "version jax pins (`pip install -e '.[test]'` does)"
        ) from None
    return list(topology.devices)


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Triton kernel of a lowered program, as XLA would launch it."""

    name: str
    ir: str  # Triton IR (TTIR) as text
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Triton kernels in a program lowered for "cuda", their IR printed as text."""
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    kernels = []

    def visit(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    op = op.operation
                    if (
                        op.name == "stablehlo.custom_call"
                        and "triton" in ir.StringAttr(op.attributes["call_target_name"]).value
                    ):
                        kernels.append(_kernel_of(ir.DictAttr(op.attributes["mhlo.backend_config"])))
                    visit(op)

    def _kernel_of(config):
        context = ir.Context()
        dialect.register_dialect(context)
        with context:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            text = str(module)

        def integer(key):
            return ir.IntegerAttr(config[key]).value

        return TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            ir=text,
            num_warps=integer("num_warps"),
            num_stages=integer("num_stages"),
            grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")),
        )

    visit(lowered.compiler_ir("stablehlo").operation)
    return kernels


@dataclasses.dataclass(frozen=True)
class TritonReport:
    """What ptxas and Triton say of one compiled kernel."""

    registers: int  # per thread
    spill_stores: int  # bytes per thread
    spill_loads: int  # bytes per thread
    shared_bytes: int  # dynamic shared memory per block
    stack_bytes: int


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_triton(kernel: TritonKernel, gpu: Target) -> TritonReport:
    """Compile one kernel's Triton IR to a cubin with pip triton and report its registers, spills and shared memory.

    Raises RuntimeError when triton is not installed (the `test` extra pins it).
    """
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        raise RuntimeError("compiling Triton IR needs the triton package; `pip install -e '.[test]'` pins it") from None
    capability = gpu.compute_capability
    with tempfile.TemporaryDirectory() as folder:
        ir_path = os.path.join(folder, f"{kernel.name}.ttir")
        with open(ir_path, "w") as f:
            f.write(kernel.ir)
        compiled = triton.compile(
            ir_path,
            target=GPUTarget("cuda", capability, 32),
            options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages),
        )
        ptx_path = os.path.join(folder, f"{kernel.name}.ptx")
        with open(ptx_path, "w") as f:
            f.write(compiled.asm["ptx"])
        arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        run = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", ptx_path, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = run.stdout + run.stderr
    registers, spills = _REGISTERS.search(log), _SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas printed no register report for {kernel.name}:\n{log}")
    return TritonReport(
        registers=int(registers.group(1)),
        spill_stores=int(spills.group(2)),
        spill_loads=int(spills.group(3)),
        shared_bytes=int(compiled.metadata.shared),
        stack_bytes=int(spills.group(1)),
    )
