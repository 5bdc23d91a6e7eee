"""The device check's CPU part runs; pallas_kernels imports with jax alone (real compilers: test_aot_compile)."""

import json
import os
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_runs_the_xla_part_on_cpu(tmp_path):
    # A small head shape: the check is that the script runs end to end on CPU and writes its table.
    small = "--iters 2 --kv_dtypes float8_e4m3fn --num_kv_heads 2 --num_q_heads 4 --head_dim 64"
    env = subprocess_env(PYTHON=sys.executable, BENCH_ARGS=small, JAX_PLATFORMS="cpu")
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


def test_device_engine_check_compares_token_by_token():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import device_engine_check

    same = {"0": [1, 2, 3, 4], "1": [5, 6]}
    assert device_engine_check.agreement(same, same) == 1.0
    assert device_engine_check.agreement(same, {"0": [1, 2, 9, 9], "1": [5, 6]}) == 4 / 6
    with pytest.raises(ValueError):  # a run that stopped early is not a partial agreement
        device_engine_check.agreement(same, {"0": [1, 2, 3], "1": [5, 6]})
    assert device_engine_check._on_this_backend("pallas") == "interpret"  # the suite runs on CPU
    assert device_engine_check._on_this_backend("xla") == "xla"
