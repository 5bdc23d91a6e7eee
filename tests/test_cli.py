"""The `paxkv` command line, end to end on the embedded SmolLM2."""

import json
import os
import subprocess
import sys


def _run_cli(*args, timeout=600):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "paxkv.run", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_answers_and_writes_metrics(tmp_path):
    metrics = tmp_path / "metrics.json"
    result = _run_cli("--prompt=What is the capital of France?", "--max_tokens=16", f"--metrics_json={metrics}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    report = json.loads(metrics.read_text())
    assert report["load_seconds"] > 0
    (request,) = report["requests"]
    assert request["prompt_tokens"] > 10 and 1 <= request["generated_tokens"] <= 16


def test_cli_missing_model_fails_with_a_clear_message(tmp_path):
    result = _run_cli(f"--model={tmp_path / 'nope'}", timeout=120)
    assert result.returncode != 0
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
