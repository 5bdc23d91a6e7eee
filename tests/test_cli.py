"""The `paxkv` command line, end to end on the embedded SmolLM2: chat, JSONL round trip, bad lines."""

import json
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

# The runs that generate share one engine shape, and cache every program they compile (in the worker's folder), so
# each compiles only what the ones before it did not.
# Steps pad to at least 8 rows (TPU's row floor): fewer SmolLM2 programs to compile.
ENGINE_FLAGS = ("--num_pages=64", "--max_model_len=128", "--max_num_batched_tokens=64", "--min_padded_seqs=8")


def _run_cli(*args, timeout=600):
    env = subprocess_env(large_model=True, PAXKV_COMPILATION_CACHE_MIN_SECONDS="0")  # the embedded SmolLM2
    return subprocess.run(
        [sys.executable, "-m", "paxkv.entrypoints.run", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_bad_lines_stop_the_run_before_anything_loads(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "hot", "temperature": -1}\n{"prompt": "x", "top_k": -2}\n')
    output = tmp_path / "out.jsonl"
    result = _run_cli(f"--prompts_file={prompts}", f"--output={output}", timeout=120)
    assert result.returncode != 0
    assert "prompts.jsonl:2: temperature must be >= 0" in result.stderr
    assert "prompts.jsonl:3: top_k must be -1 or 0" in result.stderr
    assert "--skip_bad_lines" in result.stderr and "Traceback" not in result.stderr
    assert not output.exists()


def test_missing_model_fails_with_a_clear_message(tmp_path):
    result = _run_cli(f"--model={tmp_path / 'nope'}", "--prompt=hi", timeout=120)
    assert result.returncode != 0
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_no_prompt_is_a_usage_error():
    result = _run_cli(timeout=120)
    assert result.returncode != 0
    assert "give --prompt" in result.stderr and "Traceback" not in result.stderr


SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


@pytest.fixture(scope="module")
def jsonl_runs(tmp_path_factory) -> dict:
    """One prompts file, with bad lines, run twice: prefix caching on (the default), and off with n-gram
    speculation on, drafting every proposal (neither may change a greedy token).

    The two tests below share these two runs (each loads SmolLM2 and generates in a process of its own).
    Returns label -> (records by id, the metrics summary, stderr).
    """
    folder = tmp_path_factory.mktemp("jsonl")
    lines = [
        {"id": "italy", "prompt": "The capital of Italy is", "max_tokens": 6},
        {"id": "sum", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 16},
        {"prompt": "oops", "bogus": 1},
        "not json",
        {"id": "ids", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2},
        {"id": "long", "prompt": "word " * 200},
        *[
            {"id": f"q{i}", "prompt": SYSTEM + question, "max_tokens": 8}
            for i, question in enumerate(["Name a color.", "Name a fruit.", "Name a city."])
        ],
        {"id": "salted", "prompt": SYSTEM + "Name a fruit.", "max_tokens": 8, "cache_salt": "other"},
        {"id": "samples", "prompt": "The weather today is", "max_tokens": 6, "n": 2, "seed": 1},
    ]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    runs = {}
    # Every proposal drafted: adaptive speculation would not compile a draft step for so little work.
    speculation = ["--speculative_method=ngram", "--no_adaptive_speculation"]
    for label, extra in (("on", []), ("off", ["--no_prefix_caching", *speculation])):
        output, metrics = folder / f"{label}.jsonl", folder / f"{label}.json"
        result = _run_cli(
            f"--prompts_file={prompts}",
            f"--output={output}",
            f"--metrics_json={metrics}",
            "--skip_bad_lines",
            "--temperature=0",
            *ENGINE_FLAGS,
            *extra,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in output.read_text().splitlines()]
        runs[label] = (records, json.loads(metrics.read_text())["summary"], result.stderr)
    return runs


def test_jsonl_round_trip_with_bad_lines_skipped(jsonl_runs):
    records, _, stderr = jsonl_runs["on"]
    assert [r["id"] for r in records][:6] == ["italy", "sum", "line-3", "line-4", "ids", "long"]
    assert [r["line"] for r in records] == list(range(1, 12))
    italy, total, unknown, malformed, ids, long = records[:6]
    assert "Rome" in italy["text"] and italy["num_generated_tokens"] == 6 and italy["finish_reason"] == "length"
    assert "4" in total["text"] and total["finish_reason"] == "stop"
    assert "prompts.jsonl:3: unknown field(s) ['bogus']" in unknown["error"]
    assert ":4: not valid JSON" in malformed["error"]
    assert "line 6:" in long["error"] and "max_model_len is 128" in long["error"]
    assert ids["prompt"] is None and len(ids["token_ids"]) == 4
    assert all(len(entry) >= 2 and entry[0]["rank"] == 1 for entry in ids["logprobs"])
    assert "requests finished, 3 rejected" in stderr


def test_prefix_caching_and_speculation_keep_the_tokens_and_are_summarized(jsonl_runs):
    (on_records, on_summary, on_stderr), (off_records, off_summary, off_stderr) = jsonl_runs["on"], jsonl_runs["off"]
    assert "# prefix cache:" in on_stderr and "# prefix cache:" in off_stderr
    on, off = ({r["id"]: r for r in records} for records in (on_records, off_records))
    assert {k: r.get("token_ids") for k, r in on.items()} == {k: r.get("token_ids") for k, r in off.items()}
    assert on_summary["prefix_hit_tokens"] > 0 and on_summary["prefix_hit_percent"] > 0
    assert off_summary["prefix_hit_tokens"] == 0 and off_summary["kv_pages_cached_idle"] == 0
    assert on_summary["draft_tokens"] == 0 and off_summary["draft_tokens"] > 0 and "# speculation:" in off_stderr
    assert [c["index"] for c in on["samples"]["completions"]] == [0, 1]


# After the JSONL runs, whose programs (cached in the worker's folder) cover this run's shapes: it loads them.
def test_chat_question_is_answered_and_summarized(tmp_path):
    metrics = tmp_path / "metrics.json"
    result = _run_cli(
        "--chat",
        "--prompt=What is the capital of France?",
        "--max_tokens=24",
        "--temperature=0",
        f"--metrics_json={metrics}",
        *ENGINE_FLAGS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert "requests finished" in result.stderr and "KV: peak" in result.stderr
    report = json.loads(metrics.read_text())
    summary = report["summary"]
    assert summary["requests"] == 1 and summary["rejected_requests"] == 0
    assert summary["prompt_tokens"] > 10 and 1 <= summary["generated_tokens"] <= 24
    assert 1 <= summary["peak_kv_pages_used"] <= 4 and summary["kv_pages_total"] == 63
    assert 0 <= summary["kv_waste_percent"] < 100 and summary["preemptions"] == 0
    assert report["engine"]["num_finished_requests"] == 1
