"""The memory planner (`paxkv --plan`): KV bytes per token, pool capacity and concurrency, before loading weights."""

import dataclasses
import os

import models
from models.config import ModelConfig, load_hf_config
from pallas_kernels import pages_for
from paxkv.execution.kv_pool import QUANTIZED_NAMES, kv_bytes_per_page, kv_bytes_per_token

# The KV dtypes the planner compares, by config name, with their storage dtypes.
PLAN_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "fp8_e4m3": QUANTIZED_NAMES["fp8_e4m3"], "int8": "int8"}


def plan_model_config(source: str | None) -> ModelConfig:
    """A model's config without reading its weights: a config.json, an HF folder, a .gguf file, or None (SmolLM2).

    Args:
      source: a path, or None for the embedded SmolLM2.
    """
    path = models.embedded_model_path() if source is None else os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if path.endswith(".gguf"):
        from models.gguf_loading import GGUFCheckpoint

        return GGUFCheckpoint(path).config  # metadata and tensor shapes only; the data stays on disk
    return ModelConfig.from_hf_config(load_hf_config(path))


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a Llama-family model from its shapes (biases and norms included)."""
    hidden, q_width, kv_width = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.qkv_bias:
        attention += q_width + 2 * kv_width
    if config.qk_norm:
        attention += 2 * config.head_dim
    per_layer = attention + 3 * hidden * config.intermediate_size + 2 * hidden
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * per_layer + hidden


@dataclasses.dataclass(frozen=True)
class DtypePlan:
    """Capacity of one KV dtype under the budget."""

    kv_cache_dtype: str
    bytes_per_token: float  # in full pages; an int unless the scale rows' padding does not divide page_size
    bytes_per_sequence: int  # at max_model_len, in whole pages
    num_pages: int  # usable pages in the budget (the null page excluded)
    token_capacity: int
    max_sequences_at_full_context: int


def plan(
    config: ModelConfig, *, kv_cache_memory_bytes: int, max_model_len: int, page_size: int
) -> tuple[list[DtypePlan], int]:
    """Per KV dtype: bytes per token and sequence, and what the budget holds; plus the parameter count.

    Args:
      config: the model's config.
      kv_cache_memory_bytes: the KV budget.
      max_model_len: the context each sequence may reach.
      page_size: tokens per page.
    """
    rows = []
    pages_per_sequence = pages_for(max_model_len, page_size)
    for name, dtype in PLAN_DTYPES.items():
        shape = (config.num_layers, config.num_kv_heads, config.head_dim, dtype, page_size)
        per_page = kv_bytes_per_page(*shape)
        num_pages = max(kv_cache_memory_bytes // per_page - 1, 0)
        rows.append(
            DtypePlan(
                kv_cache_dtype=name,
                bytes_per_token=kv_bytes_per_token(*shape),
                bytes_per_sequence=per_page * pages_per_sequence,
                num_pages=num_pages,
                token_capacity=num_pages * page_size,
                max_sequences_at_full_context=num_pages // pages_per_sequence,
            )
        )
    return rows, parameter_count(config)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def format_plan(
    config: ModelConfig,
    rows: list[DtypePlan],
    num_params: int,
    *,
    max_model_len: int,
    page_size: int,
    kv_cache_memory_bytes: int,
    chosen: str,
) -> str:
    """The plan as text, ending with how KV per sequence compares with the weights."""
    weights_bf16 = 2 * num_params
    lines = [
        f"model: {config.model_type}, {config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} KV "
        f"heads of {config.head_dim}, {num_params / 1e9:.2f} B parameters = {_gib(weights_bf16)} in bf16, "
        f"{_gib(2 * weights_bf16)} in f32",
        f"KV per token = 2 x {config.num_kv_heads} KV heads x {config.head_dim} x dtype bytes x {config.num_layers} "
        "layers (+ for fp8 and int8 a 4-byte word of K and V scales per token and head, its row per page padded "
        "to 128 words)",
        f"budget {_gib(kv_cache_memory_bytes)}, max_model_len {max_model_len}, page_size {page_size}:",
        "",
        f"{'kv dtype':<10} {'bytes/token':>12} {'KV/sequence':>14} {'pages':>10} {'tokens':>12} "
        f"{'seqs at full ctx':>17}",
    ]
    for row in rows:
        marker = "  <- --kv_cache_dtype" if row.kv_cache_dtype == chosen else ""
        lines.append(
            f"{row.kv_cache_dtype:<10} {row.bytes_per_token:>12,.0f} {_gib(row.bytes_per_sequence):>14} "
            f"{row.num_pages:>10,} {row.token_capacity:>12,} {row.max_sequences_at_full_context:>17,}{marker}"
        )
    bf16 = next(row for row in rows if row.kv_cache_dtype == "bfloat16")
    ratio = bf16.bytes_per_sequence / weights_bf16
    comparison = "more than" if ratio > 1 else "less than"
    lines += [
        "",
        f"One sequence at full context holds {_gib(bf16.bytes_per_sequence)} of bf16 KV: {100 * ratio:.0f}% of the "
        f"bf16 weights, {comparison} the weights themselves.",
    ]
    if config.num_kv_heads < config.num_heads:
        without_gqa = bf16.bytes_per_sequence * config.num_heads // config.num_kv_heads
        lines.append(
            f"Without grouped-query attention ({config.num_heads} KV heads) it would be {_gib(without_gqa)}, "
            f"{100 * without_gqa / weights_bf16:.0f}% of the weights."
        )
    return "\n".join(lines)
