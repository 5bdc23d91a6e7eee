"""Deviceless compiles: the kernels by libtpu's Mosaic (v5e, v6e) and by triton for sm_90, the engine step and its
chained decode program by libtpu, and the start-up check that the largest step fits in device memory.

These run the real compilers (the `test` extra pins libtpu and triton); a missing compiler fails, it does not
skip. TPU cases compile in a worker process (scripts/aot_compile.py), 8 to a program: some bad layouts abort
libtpu.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

import models
import pallas_kernels
import paxkv.execution.model_runner
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.execution.aot import AbstractEngine, check_step_fits, compile_step
from paxkv.parallel.mesh import make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "aot_compile.py")


def _aot(tmp_path, *args, timeout=900) -> dict:
    """Run scripts/aot_compile.py without the tests' CPU flags; return its JSON (the run must succeed)."""
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    run = subprocess.run(
        [sys.executable, SCRIPT, *args, f"--json={out}"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e"])
def test_tpu_kernel_compiles_with_mosaic(tmp_path, target):
    """The CI subset: Llama-3-8B's and SmolLM2's head shapes in every page dtype and batch kind, and corners of
    every axis (pages 16-128, head_dim 64-256, 1-8 KV heads, GQA 1-8). scripts/aot_compile.py --kernels full
    compiles the whole product."""
    # One compiling process, not the script's default two: beside the other test worker the second only
    # time-slices the same cores, and each costs a start of jax and libtpu (v5e alone: 20.8 against 23.8 s of CPU).
    result = _aot(tmp_path, f"--target={target}", "--kernels=ci", "--jobs=1")
    rows = result["rows"]
    assert all(row["status"] == "ok" for row in rows), [r for r in rows if r["status"] != "ok"]
    assert {row["compiled_with"] for row in rows} == {8}  # 8 to a program (v5e: 27.1 to 18.6 s alone)
    cases = [row["case"] for row in rows]
    for axis, values in (
        ("page_size", {16, 32, 64, 128}),
        ("head_dim", {64, 128, 256}),
        ("num_kv_heads", {1, 2, 3, 8}),
        ("kv_dtype", {"bfloat16", "float32", "float8_e4m3fn", "int8"}),
        ("kind", {"decode", "prefill", "mixed"}),
    ):
        assert values <= {case[axis] for case in cases}, axis
    assert {case["group"] for case in cases} >= {1, 2, 3, 4, 5, 6, 7, 8}


def test_a_group_that_fails_is_compiled_case_by_case_so_the_error_names_its_case(monkeypatch):
    """The script compiles TPU cases 8 to a program; when that program fails, each case compiles alone, and only
    the one that fails (here: made to raise when its queries are f32) reports an error."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import aot_compile

    from pallas_kernels import deviceless

    real = pallas_kernels.ragged_paged_attention_tpu

    def fails_on_f32_queries(q, kv, metadata, **options):
        if q.dtype == jax.numpy.float32:
            raise ValueError("injected: no f32 queries")
        return real(q, kv, metadata, **options)

    monkeypatch.setattr(pallas_kernels, "ragged_paged_attention_tpu", fails_on_f32_queries)
    mesh = jax.sharding.Mesh(deviceless.tpu_devices(deviceless.target("tpu-v5e"))[:1], ("model",))
    cases = aot_compile.kernel_cases("tpu", "ci")[:3]  # Llama-3-8B decode: bfloat16, float32, float8_e4m3fn
    rows = aot_compile.compile_tpu_cases(cases, mesh)
    assert [row["case"]["kv_dtype"] for row in rows] == ["bfloat16", "float32", "float8_e4m3fn"]
    assert [row["status"] for row in rows] == ["ok", "error", "ok"]
    assert "injected: no f32 queries" in rows[1]["message"]
    assert all(row["compiled_with"] == 1 for row in rows)


def test_gpu_kernel_compiles_for_sm90_within_its_limits(tmp_path):
    """ptxas for sm_90a: no spills in decode tiles (one token, padded query heads), at most 256 bytes a thread
    in prefill and mixed tiles, and shared memory within H200's 227 KiB."""
    result = _aot(tmp_path, "--target=gpu-sm90", "--kernels=ci")
    rows = result["rows"]
    assert {row["case"]["kv_dtype"] for row in rows} == {"bfloat16", "float8_e4m3fn", "int8"}
    for row in rows:
        assert row["status"] == "ok", row
        limit = 0 if row["case"]["kind"] == "decode" else 256
        assert row["spill_stores"] <= limit and row["spill_loads"] <= limit, row
        assert row["shared_bytes"] <= 227 * 1024, row
        assert 0 < row["registers"] <= 255, row
        if row["case"]["kind"] == "decode":
            assert row["tile"].startswith("16x") and "(1 tok x 16 heads" in row["tile"], row


def test_engine_step_compiles_for_tpu_and_reports_memory(tmp_path):
    """The engine step (forward with the KV write, and sampling) for SmolLM2 (2 of its 30 layers, for time: the layers
    repeat one program; the script's tables in BUILD.md compile all of them) on one v5e chip, from shapes alone."""
    result = _aot(
        tmp_path,
        "--target=tpu-v5e",
        "--model=smollm2",
        "--num_layers=2",
        "--buckets=largest",
        "--kv_cache_memory=2GiB",
    )
    step, chained = result["steps"]
    assert step["status"] == "ok" and (step["num_tokens"], step["num_seqs"], step["num_passes"]) == (512, 32, 1)
    # The chained decode program too: 8 passes (EngineConfig's default) of a 32-row decode in one loop.
    assert chained["status"] == "ok"
    assert (chained["num_tokens"], chained["num_seqs"], chained["num_passes"]) == (32, 32, 8)
    for program in (step, chained):
        # The arguments are the bf16 weights (~0.06 GB: 2 layers and the embedding) plus the 2 GiB pool, aliased
        # by the pool it returns.
        assert 2 * 2**30 < program["argument_bytes"] < 2.25 * 2**30
        assert program["alias_bytes"] >= 2 * 2**30 - 2**20
        assert program["total_bytes"] <= result["setup"]["hbm_bytes"] and program["flops"] > 0


@pytest.mark.parametrize("target,mesh", [("tpu-v5e", "data=1,model=4"), ("tpu-v6e", "data=1,model=8")])
def test_sharded_engine_step_compiles_for_tpu(tmp_path, target, mesh):
    """A Llama-3-8B-shaped step (1 of its layers, for time: each layer is the same program) on model=4 and model=8
    meshes: the Pallas kernel runs per shard with every mesh axis manual (libtpu refuses to partition a Mosaic
    call), and each chip holds its share of the pool.

    The step is the largest of budgets of 64 tokens and 8 rows, a prefill chunk and a batch of decodes: at the
    default 512 and 32 its forward compiles in 15 s, at these in 5 (v6e, model=8). Nothing checked here depends on
    T or S; test_engine_step_compiles_for_tpu_and_reports_memory compiles the default budgets' largest step, and
    BUILD.md's engine-step table that step of Llama-3-8B's whole model on these meshes (scripts/aot_compile.py)."""
    result = _aot(
        tmp_path,
        f"--target={target}",
        "--model=llama3-8b",
        f"--mesh={mesh}",
        "--num_layers=1",
        "--max_num_batched_tokens=64",
        "--max_num_seqs=8",
        "--buckets=largest",
        "--kv_cache_memory=16GiB",
    )
    step, chained = result["steps"]  # the step, and the chained decode program over its 8 rows
    assert step["status"] == "ok" and (step["num_tokens"], step["num_seqs"]) == (64, 8), step
    assert chained["status"] == "ok" and (chained["num_seqs"], chained["num_passes"]) == (8, 8), chained
    chips = result["setup"]["chips"]
    pool_per_chip = 16 * 2**30 / chips
    for program in (step, chained):
        assert pool_per_chip < program["argument_bytes"] < pool_per_chip + 2**30  # the pool's shard, the weights'


def test_a_step_too_big_for_the_device_is_refused_at_start(tiny_llama_checkpoint, monkeypatch):
    """Where the device reports a memory limit, Engine compiles its largest step at start and refuses to run
    when the step cannot fit beside the weights and the pool."""
    loaded = models.load(tiny_llama_checkpoint(), require_tokenizer=False)
    config = EngineConfig(num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    monkeypatch.setattr("paxkv.execution.model_runner.device_memory", lambda mesh: (2**30, 2**30 - 1000))
    with pytest.raises(ValueError, match=r"largest step \(T=64 tokens, S=4 rows.*lower kv_cache_memory_bytes"):
        Engine(loaded, config)
    monkeypatch.setattr("paxkv.execution.model_runner.device_memory", lambda mesh: (2**30, 0))
    engine = Engine(loaded, config)  # room to spare: it starts
    assert engine.scheduler.num_total_pages > 0


@pytest.mark.parametrize("mesh_shape", ["data=2,model=2", "data=1,model=2"])
def test_the_start_check_compiles_the_engines_own_step_program(tiny_llama_checkpoint, mesh_shape):
    """The largest step compiled ahead of time from a live engine's state (with D = 2 replicas, or 1) holds the
    pool's shard as a donated, aliased argument."""
    mesh = make_mesh(mesh_shape)
    loaded = models.load(tiny_llama_checkpoint(), mesh=mesh, require_tokenizer=False)
    engine = Engine(loaded, EngineConfig(num_pages=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=32))
    state = AbstractEngine(
        loaded.graphdef, loaded.state, engine.kv_caches, 8, engine.runner.pages_per_seq, loaded.config.vocab_size, mesh
    )
    program = compile_step(state, 32, 4, with_logprobs=True, vocab_arrays=True)
    pool_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.kv_caches)) // mesh.size
    assert program.memory.alias_bytes >= pool_bytes > 0
    assert program.memory.argument_bytes > pool_bytes and program.flops > 0


@pytest.mark.parametrize("num_scheduler_steps", [8, 1])
def test_the_start_check_compiles_the_largest_chained_decode_step(
    tiny_llama_checkpoint, monkeypatch, num_scheduler_steps
):
    """Where decodes chain, Engine also compiles its largest chained decode step at start (S rows, K passes) and
    checks it against the device's memory: a chain too large for it is refused with the chain among the fixes."""
    loaded = models.load(tiny_llama_checkpoint(), require_tokenizer=False)
    config = EngineConfig(
        num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=64, num_scheduler_steps=num_scheduler_steps
    )
    real, compiled = paxkv.execution.model_runner.compile_chained_step, []

    def recording(*args):
        compiled.append(real(*args))
        return compiled[-1]

    monkeypatch.setattr(paxkv.execution.model_runner, "compile_chained_step", recording)
    monkeypatch.setattr("paxkv.execution.model_runner.device_memory", lambda mesh: (2**30, 0))
    Engine(loaded, config)  # room to spare: it starts
    if num_scheduler_steps == 1:
        assert not compiled  # nothing chains, so no chained program is checked
        return
    (program,) = compiled
    assert (program.num_seqs, program.num_passes) == (4, 8) and program.memory.beyond_arguments_bytes > 0
    needed = program.memory.beyond_arguments_bytes
    message = r"largest chained decode step \(S=4 rows, 8 passes; .*lower kv_cache_memory_bytes.*num_scheduler_steps=1"
    with pytest.raises(ValueError, match=message):
        check_step_fits(program, 2**30, 2**30 - needed + 1, what="max_num_seqs=4, num_scheduler_steps=8")
    check_step_fits(program, 2**30, 2**30 - needed, what="")  # exactly room enough
