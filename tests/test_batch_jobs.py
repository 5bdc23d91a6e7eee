"""Batch jobs lose nothing: output paths checked before load, a journal, SIGINT/SIGTERM and kill -9 mid-batch,
and --resume, all through the real `paxkv` command line on conftest's word-level tiny Llama."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from subprocess_env import subprocess_env

from paxkv.entrypoints.output_files import journal_path

NUM_LINES = 16
# Two rows at a time and 16 tokens each: over a hundred steps, so a signal sent once 3 lines have finished lands
# mid-batch. ignore_eos keeps every line's length fixed.
RUN_FLAGS = (
    "--temperature=0",
    "--max_tokens=16",
    "--attention_impl=xla",
    "--num_pages=64",
    "--page_size=8",
    "--max_num_seqs=2",
    "--min_padded_seqs=8",  # every step pads to the 2 rows and 16 tokens: fewer programs to compile
    "--min_padded_tokens=16",
    "--noprogress",
)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "prompts.jsonl"
    lines = [
        {"id": f"q{i}", "prompt": " ".join(f"w{(7 * i + j) % 250 + 3}" for j in range(3 + i % 5)), "ignore_eos": True}
        for i in range(NUM_LINES)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _command(model_dir, prompts, output, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "paxkv.entrypoints.run",
        f"--model={model_dir}",
        f"--prompts_file={prompts}",
        f"--output={output}",
        *RUN_FLAGS,
        *extra,
    ]


def _env() -> dict:
    # Cache every compilation (the worker's folder), so each run after the first loads its programs.
    return subprocess_env(PAXKV_COMPILATION_CACHE_MIN_SECONDS="0")


def _run(command, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _tokens(records) -> dict[str, list[int]]:
    return {r["id"]: r["token_ids"] for r in records}


@pytest.fixture(scope="module")
def uninterrupted(word_level_llama, prompts_file, tmp_path_factory) -> dict[str, list[int]]:
    """Every line's greedy tokens from one run left alone."""
    output = tmp_path_factory.mktemp("uninterrupted") / "out.jsonl"
    result = _run(_command(word_level_llama, prompts_file, output))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"tokens of float32, \d+ bytes per token, \d+ MiB", result.stderr)  # no "8-bit scales" note
    records = _records(output)
    assert [r["id"] for r in records] == [f"q{i}" for i in range(NUM_LINES)]
    assert all(len(r["token_ids"]) == 16 and r["finish_reason"] == "length" for r in records)
    assert not os.path.exists(journal_path(str(output)))  # removed once the output holds everything
    return _tokens(records)


def _start_and_wait_for_journal(command, output, min_lines=3, timeout=240) -> subprocess.Popen:
    """Start the run, and return once its journal holds `min_lines` finished lines."""
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = journal_path(str(output))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(journal) and sum(1 for _ in open(journal)) >= min_lines:
            return process
        if process.poll() is not None:
            raise AssertionError(f"the run ended before its journal had {min_lines} lines: {process.stderr.read()}")
        time.sleep(0.01)
    process.kill()
    raise AssertionError("the journal never reached {min_lines} lines")


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_batch_keeps_what_finished_and_resume_completes_it(
    word_level_llama, prompts_file, uninterrupted, tmp_path, signal_number
):
    output = tmp_path / "out.jsonl"
    command = _command(word_level_llama, prompts_file, output)
    process = _start_and_wait_for_journal(command, output)
    process.send_signal(signal_number)
    _, stderr = process.communicate(timeout=120)
    name = signal.Signals(signal_number).name
    assert process.returncode == 128 + signal_number, stderr[-3000:]  # 130 or 143
    assert "Traceback" not in stderr
    assert f"paxkv: {name}: stopping after this step" in stderr
    assert "Rerun the same command with --resume to finish them." in stderr

    records = _records(output)  # every line has a record, in input order
    assert [r["id"] for r in records] == [f"q{i}" for i in range(NUM_LINES)]
    finished = [r for r in records if r["finish_reason"] == "length"]
    aborted = [r for r in records if r["finish_reason"] == "abort"]
    assert len(finished) >= 3 and aborted and len(finished) + len(aborted) == NUM_LINES
    assert all(r["token_ids"] == uninterrupted[r["id"]] for r in finished)
    assert all(f"interrupted by {name} before it finished" in r["reason"] for r in aborted)
    assert len(_records(journal_path(str(output)))) == len(finished)  # kept for --resume

    resumed = _run(command + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"# --resume: {len(finished)} of {NUM_LINES} lines already finished" in resumed.stderr
    # Its programs come from the compilation cache, and the summary says so apart from the generation rate.
    compiling = re.search(r"# compiling: [\d.]+ s of that for (\d+) programs compiled and (\d+) loaded", resumed.stderr)
    assert compiling and int(compiling[2]) > 0, resumed.stderr[-2000:]
    assert _tokens(_records(output)) == uninterrupted
    assert not os.path.exists(journal_path(str(output)))


def test_kill_9_leaves_a_journal_that_resume_completes(word_level_llama, prompts_file, uninterrupted, tmp_path):
    output = tmp_path / "out.jsonl"
    command = _command(word_level_llama, prompts_file, output)
    process = _start_and_wait_for_journal(command, output)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not output.exists()  # never half-written under the real name
    journaled = _records(journal_path(str(output)))
    assert len(journaled) >= 3 and all(r["token_ids"] == uninterrupted[r["id"]] for r in journaled)

    again = _run(command, timeout=120)  # without --resume, the journal's results are not thrown away
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert (
        f"paxkv: {journal_path(str(output))} holds the results an earlier run of this output finished; rerun "
        "with --resume to keep them and run the rest, or delete it to start over" in again.stderr
    )

    resumed = _run(command + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _tokens(_records(output)) == uninterrupted


def test_a_second_signal_exits_at_once_with_the_journal_intact(word_level_llama, prompts_file, uninterrupted, tmp_path):
    output = tmp_path / "out.jsonl"
    process = _start_and_wait_for_journal(_command(word_level_llama, prompts_file, output), output)
    # Two different signals, since the kernel merges a second SIGINT still pending with the first.
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr[-2000:]
    assert "paxkv: second signal (SIGTERM); exiting now, the journal holds what finished" in stderr
    journaled = _records(journal_path(str(output)))
    assert len(journaled) >= 3 and all(r["token_ids"] == uninterrupted[r["id"]] for r in journaled)


def test_resume_refuses_a_finished_line_that_changed(word_level_llama, prompts_file, uninterrupted, tmp_path):
    output = tmp_path / "out.jsonl"
    records = [
        {"id": f"q{i}", "line": i + 1, "input_hash": "0" * 16, "finish_reason": "length", "token_ids": tokens}
        for i, tokens in enumerate(uninterrupted.values())
    ][:2]
    output.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = _run(_command(word_level_llama, prompts_file, output, "--resume"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert (
        "--resume: line 1 (id 'q0'), line 2 (id 'q1') changed since the earlier run finished it (prompt, messages, "
        "cache_salt or sampling fields, flags included)" in result.stderr
    )


@pytest.mark.parametrize(
    "flag,where,message",
    [
        ("--output", "missing/out.jsonl", "paxkv: --output {path}: the folder {tmp}/missing does not exist; create it"),
        (
            "--metrics_json",
            ".",
            "paxkv: --metrics_json {path} is a folder; give a file path, e.g. {path}/results.jsonl",
        ),
    ],
)
def test_unwritable_paths_fail_before_the_model_loads(word_level_llama, prompts_file, tmp_path, flag, where, message):
    """A missing folder, or a folder given as the file: one line naming the flag and the fix, and no run."""
    output = tmp_path / "out.jsonl"
    path = os.path.normpath(tmp_path / where)
    result = _run(_command(word_level_llama, prompts_file, output) + [f"{flag}={path}"], timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert message.format(path=path, tmp=tmp_path) in result.stderr
    assert "# model" not in result.stderr and not output.exists()  # stopped before loading


def test_an_empty_prompts_file_says_so(word_level_llama, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    result = _run(_command(word_level_llama, empty, tmp_path / "out.jsonl"), timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"paxkv: --prompts_file {empty} is empty; give one JSON object per line" in result.stderr


def test_help_lists_paxkvs_own_flags():
    """`paxkv --help` (the console script, whose main module defines no flags) lists the runner's flags."""
    script = os.path.join(os.path.dirname(sys.executable), "paxkv")
    result = subprocess.run([script, "--help"], env=_env(), capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("The `paxkv` command line"), result.stderr[-2000:]  # absl exits 1 after help
    for flag in ("prompts_file", "resume", "max_num_seqs", "kv_cache_dtype", "allow_nonfinite_weights"):
        assert re.search(rf"^  --(\[no\])?{flag}\b", result.stdout, re.MULTILINE), flag
    assert "SamplingParams defaults to\n    vLLM's 16" in result.stdout  # why the runner's max_tokens is 64
