"""Smoke runs of the scripts no other test drives, on a tiny model: each runs to the end and writes sane results."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, make_tiny_llama):
    path = tmp_path_factory.mktemp("tiny_scripts")
    make_tiny_llama().save_pretrained(path)
    return path


def _script(name: str, *args, timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user runs it
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_profile_step_splits_a_decode_step(tiny_model, tmp_path):
    out = tmp_path / "profile"
    run = _script(
        "profile_step.py", f"--model={tiny_model}", "--batch=2", "--prompt_len=8", "--steps=3", f"--out={out}"
    )
    result = json.loads((tmp_path / "profile.json").read_text())
    phases, split = result["phases_ms"], result["device_split_ms"]
    assert set(phases) >= {"schedule", "step_inputs", "sampling_arrays", "device", "step_total", "host_other"}
    assert all(phases[name] > 0 for name in ("schedule", "step_inputs", "device", "step_total"))
    assert phases["step_total"] >= phases["device"]
    assert split["device_step_ms"] > 0 and split["device_step_without_attention_ms"] > 0 and split["lm_head_ms"] > 0
    assert (tmp_path / "profile.md").read_text() in run.stdout
