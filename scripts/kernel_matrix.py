"""The attention-kernel cases scripts/aot_compile.py compiles: the matrix (`ci`, `covering`, `full`), each case's
abstract inputs, and the tiling and VMEM the kernel chooses for it."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels import AttentionMetadata, QuantizedKVPages
from pallas_kernels.quantization import scale_lanes

# Tokens and sequence rows of each batch kind; decode batches are decode-shaped (T <= S).
BATCH_SHAPES = {"decode": (64, 64), "prefill": (512, 8), "mixed": (256, 32)}
CONTEXT = 4096  # block-table width in tokens
NUM_PAGES = 2048
KV_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "int8")


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


def case_tile(case: KernelCase, q, pool, metadata) -> str:
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


def case_vmem_bytes(q, pool, metadata) -> int:
    """The TPU kernel's VMEM buffers for the case, in bytes (its own estimate; it asks for twice that, >= 32 MiB)."""
    from pallas_kernels.ragged_paged_attention_tpu import _vmem_estimate, tpu_layout

    quantized = isinstance(pool, QuantizedKVPages)
    values = pool.pages if quantized else pool
    options = dict(sm_scale=0.1, sliding_window=None, soft_cap=None, queries_per_block=None, pages_per_block=None)
    layout = tpu_layout(q, values, metadata, quantized=quantized, **options)
    scale_window = pool.scales.shape[-1] // layout.num_head_blocks if quantized else 0
    return _vmem_estimate(layout, q.dtype, values.dtype, scale_window)
