"""The kernels lower for their hardware, and the device check's CPU part runs."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from kernel_cases import batch_lengths, make_case

from pallas_kernels import paged_attention_gpu, ragged_paged_attention_tpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(kind, kv_dtype):
    kv_lens, q_lens = batch_lengths(kind, 16)
    return make_case(
        0,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=128,
        kv_dtype=kv_dtype,
        padded_tokens=64,
        padded_rows=8,
        q_dtype=jnp.bfloat16,
    )


def _lower(kernel, case, platform) -> str:
    fn = jax.jit(lambda q, kv, m: kernel(q, kv, m, sm_scale=0.1))
    return fn.trace(case.q, case.kv_pages, case.metadata).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "int8"])
def test_gpu_kernel_lowers_to_triton(kind, kv_dtype):
    """Cross-platform lowering runs every Triton lowering rule (power-of-two tiles, supported ops) without a GPU."""
    text = _lower(paged_attention_gpu, _case(kind, kv_dtype), "cuda")
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "int8"])
def test_tpu_kernel_lowers_to_mosaic(kind, kv_dtype, monkeypatch):
    """Lowering to Mosaic runs the Pallas TPU lowering rules; the chip is named since this machine has none."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "get_device_kind"):
        pytest.skip("this jax names the TPU chip differently")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5e")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    text = _lower(ragged_paged_attention_tpu, _case(kind, kv_dtype), "tpu")
    assert "tpu_custom_call" in text


def test_device_check_runs_the_xla_part_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, BENCH_ARGS="--iters 2 --kv_dtypes float8_e4m3fn", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    run = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "device_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "benchmarking the XLA path" in run.stdout
    result = json.loads((tmp_path / "kernels.json").read_text())
    workloads = {row["workload"].split()[0] for row in result["rows"] if row.get("ms", 0) > 0}
    assert workloads == {"decode", "mixed", "kv"}
    assert result["copy_gb_per_s"] > 0
    assert (tmp_path / "kernels.md").read_text() in run.stdout  # the table is printed


def test_pallas_kernels_import_on_their_own():
    """pallas_kernels depends on jax only: importing it loads no flax, models or paxkv."""
    code = (
        "import sys, pallas_kernels; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'flax', 'models', 'paxkv', 'torch', 'transformers'}); "
        "print(bad); sys.exit(bool(bad))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
