"""Paged-attention kernels, the CPU's native matmuls, and their pure-jnp references; depends on jax only."""

from pallas_kernels.cpu_amx_matmul import MAX_AMX_ROWS, MIN_AMX_ROWS, amx_matmul_cpu, amx_matmul_reads
from pallas_kernels.cpu_blocked_matmul import MIN_BLOCKED_ROWS, blocked_matmul_cpu, blocked_matmul_reads
from pallas_kernels.cpu_gated_mlp import gated_mlp_cpu, gated_mlp_reference
from pallas_kernels.cpu_greedy_token import first_argmax, greedy_tokens_cpu, greedy_tokens_reference
from pallas_kernels.cpu_panel_matmul import (
    INT8_GROUP_ROWS,
    PANEL_WIDTH,
    bf16_panels_pay,
    dequantized_matrix,
    pack_panels,
    pack_panels_bf16,
    panel_layout_pays,
    panel_matmul_cpu,
    panel_matmul_reference,
    panel_matmuls_cpu,
    quantize_panels_int8,
    rms_norm_reference,
    unpack_panels,
)
from pallas_kernels.cpu_small_matmul import (
    MAX_NATIVE_ROWS,
    native_matmul_reads,
    small_matmul_cpu,
    small_matmul_reference,
)
from pallas_kernels.kv_pages import (
    allocate_pages,
    heads_split,
    num_kv_heads_of,
    page_bytes,
    page_view,
    pages_for,
    pool_partition_spec,
    write_kv,
    write_pages,
)
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ops import (
    ATTENTION_IMPLS,
    RESOLVED_IMPLS,
    paged_attention,
    ragged_attention,
    resolve_attention_impl,
)
from pallas_kernels.paged_attention_gpu import paged_attention_gpu
from pallas_kernels.quantization import (
    QuantizedKVPages,
    empty_quantized_pages,
    is_quantized,
    quantize_per_row,
    rotation_matrix,
)
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = [
    "bf16_panels_pay",
    "first_argmax",
    "gated_mlp_cpu",
    "gated_mlp_reference",
    "greedy_tokens_cpu",
    "greedy_tokens_reference",
    "INT8_GROUP_ROWS",
    "ATTENTION_IMPLS",
    "AttentionMetadata",
    "MAX_AMX_ROWS",
    "MAX_NATIVE_ROWS",
    "MIN_AMX_ROWS",
    "MIN_BLOCKED_ROWS",
    "PANEL_WIDTH",
    "QuantizedKVPages",
    "RESOLVED_IMPLS",
    "allocate_pages",
    "amx_matmul_cpu",
    "amx_matmul_reads",
    "blocked_matmul_cpu",
    "blocked_matmul_reads",
    "dequantized_matrix",
    "empty_quantized_pages",
    "heads_split",
    "is_quantized",
    "native_matmul_reads",
    "num_kv_heads_of",
    "pack_panels",
    "pack_panels_bf16",
    "page_bytes",
    "page_view",
    "pages_for",
    "panel_layout_pays",
    "panel_matmul_cpu",
    "panel_matmul_reference",
    "panel_matmuls_cpu",
    "pool_partition_spec",
    "paged_attention",
    "paged_attention_gpu",
    "quantize_panels_int8",
    "quantize_per_row",
    "ragged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_attention_tpu",
    "rms_norm_reference",
    "rotation_matrix",
    "small_matmul_cpu",
    "small_matmul_reference",
    "unpack_panels",
    "resolve_attention_impl",
    "write_kv",
    "write_pages",
]
