"""Multi-process runs on 127.0.0.1: two processes of two CPU devices each give the single-process outputs."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from subprocess_env import subprocess_env

from paxkv.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["w1 w2 w3 w4 w5", "w7 w8 w9", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20"]


@pytest.fixture(scope="module")
def tiny_model(word_level_llama, tmp_path_factory):
    """conftest's word-level tiny Llama (4 KV heads, so model=4 splits them), and a prompts file."""
    prompts = tmp_path_factory.mktemp("multihost") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return word_level_llama, prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int = 2) -> dict:
    # Not conftest's 8 forced host devices: each process here has its own count.
    return subprocess_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=ROOT)


def _run_flags(model_dir, prompts) -> list[str]:
    return [
        f"--model={model_dir}",
        f"--prompts_file={prompts}",
        "--max_tokens=8",
        "--temperature=0",
        "--attention_impl=xla",
        "--num_pages=64",
        "--page_size=8",
        "--max_num_seqs=4",
        "--min_padded_seqs=8",  # every step pads to the 4 rows and 32 tokens: fewer programs to compile
        "--min_padded_tokens=32",
    ]


def _tokens(path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["token_ids"] for line in f]


@pytest.fixture(scope="module")
def single_process_tokens(tiny_model, tmp_path_factory) -> list[list[int]]:
    """The CLI's greedy tokens for the prompts file, from one process."""
    model_dir, prompts = tiny_model
    output = tmp_path_factory.mktemp("single") / "single.jsonl"
    single = subprocess.run(
        [sys.executable, "-m", "paxkv.entrypoints.run", *_run_flags(model_dir, prompts), f"--output={output}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    tokens = _tokens(output)
    assert len(tokens) == len(PROMPTS)
    return tokens


def test_two_processes_match_one_and_only_process_0_writes(tiny_model, single_process_tokens, tmp_path):
    model_dir, prompts = tiny_model
    flags = _run_flags(model_dir, prompts)
    port = _free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paxkv.entrypoints.run",
                *flags,
                "--mesh=data=1,model=4",  # spans both processes' devices: the collectives cross them
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                f"--output={tmp_path / f'out-{i}.jsonl'}",
                f"--metrics_json={tmp_path / f'metrics-{i}.json'}",
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=300) for p in processes]
    for process, (_, stderr) in zip(processes, results, strict=True):
        assert process.returncode == 0, stderr[-2000:]
    assert _tokens(tmp_path / "out-0.jsonl") == single_process_tokens
    assert (tmp_path / "metrics-0.json").exists()
    assert not (tmp_path / "out-1.jsonl").exists() and not (tmp_path / "metrics-1.json").exists()
    assert "requests finished" in results[0][1] and "requests finished" not in results[1][1]


def test_launch_script_runs_data_parallel_replicas_one_per_process(tiny_model, single_process_tokens, tmp_path):
    """data=2,model=2 over 2 processes of 2 devices: each process holds one replica and its share of the pool."""
    model_dir, prompts = tiny_model
    output = tmp_path / "out.jsonl"
    env = dict(_env(), PYTHON=sys.executable, PAXKV_LOG_DIR=str(tmp_path / "logs"))
    result = subprocess.run(
        [
            "bash",
            os.path.join(ROOT, "scripts", "launch_multihost.sh"),
            "2",
            *_run_flags(model_dir, prompts),
            "--mesh=data=2,model=2",
            f"--output={output}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert _tokens(output) == single_process_tokens
    assert "3 requests finished" in result.stderr  # process 0's summary
    assert "requests finished" not in (tmp_path / "logs" / "process-1.log").read_text()


def test_processes_without_a_coordinator_are_refused():
    with pytest.raises(ValueError, match="without a coordinator; pass --coordinator_address"):
        distributed.initialize(None, 2, 0)
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"process_id=2 must lie in \[0, num_processes=2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    assert distributed.initialize() is False  # no flags: a single-process run, nothing started


def test_settings_come_from_the_environment_when_no_flag_is_given(monkeypatch):
    monkeypatch.setenv("PAXKV_NUM_PROCESSES", "2")
    monkeypatch.setenv("PAXKV_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="without a coordinator"):
        distributed.initialize()
    monkeypatch.setenv("PAXKV_PROCESS_ID", "first")
    with pytest.raises(ValueError, match="PAXKV_PROCESS_ID='first' is not a non-negative integer"):
        distributed.initialize()


def test_unreachable_coordinator_fails_after_the_timeout_with_a_clear_error(tmp_path):
    """Process 1 of 2 waits for a coordinator nobody started, and gives up after --distributed_timeout."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paxkv.entrypoints.run",
            "--prompt=w1",
            f"--coordinator_address=127.0.0.1:{_free_port()}",
            "--num_processes=2",
            "--process_id=1",
            "--distributed_timeout=3",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "could not join the multi-process run at 127.0.0.1:" in result.stderr
    assert "within 3 s" in result.stderr and "Traceback" not in result.stderr


def test_a_signal_to_one_process_stops_every_process_at_the_same_step(tiny_model, tmp_path):
    """SIGTERM to process 1 alone: both stop after the same step (else process 0 would wait in a collective),
    process 0 writes what finished and the aborted lines with the reason, and each exits with a code."""
    model_dir, _ = tiny_model
    prompts = tmp_path / "long.jsonl"
    lines = [{"id": f"q{i}", "prompt": f"w{i + 1} w{i + 2}", "max_tokens": 16, "ignore_eos": True} for i in range(16)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output, port = tmp_path / "out.jsonl", _free_port()
    flags = [*_run_flags(model_dir, prompts), "--max_num_seqs=2", "--noprogress", "--mesh=data=1,model=4"]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paxkv.entrypoints.run",
                *flags,
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                f"--output={output}",
            ],
            env=subprocess_env(
                JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", PYTHONPATH=ROOT, PAXKV_COMPILATION_CACHE_MIN_SECONDS="0"
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    journal = f"{output}.journal"
    deadline = time.monotonic() + 240
    while not (os.path.exists(journal) and sum(1 for _ in open(journal)) >= 2):
        assert time.monotonic() < deadline and processes[0].poll() is None, processes[0].stderr.read()
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    (_, leader_err), (_, other_err) = (p.communicate(timeout=120) for p in processes)
    assert processes[1].returncode == 143 and "Traceback" not in other_err, other_err[-2000:]
    assert processes[0].returncode == 1 and "Traceback" not in leader_err, leader_err[-2000:]
    assert "paxkv: another process's signal: " in leader_err and "--resume" in leader_err
    records = [json.loads(line) for line in open(output)]
    assert [r["id"] for r in records] == [f"q{i}" for i in range(16)]
    aborted = [r for r in records if r["finish_reason"] == "abort"]
    assert aborted and len(aborted) < 16
    assert all(r["reason"].startswith("another process of this run was interrupted") for r in aborted)
