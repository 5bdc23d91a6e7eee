"""Step programs compiled on a worker thread ahead of use (paxkv.execution.ahead_compiler): a step that runs them
compiles nothing and computes what the jitted step computes, and adaptive speculation never runs a speculating
step it would have to compile."""

import numpy as np
import pytest

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.scheduling.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Every step pads to 16 rows, 16 draft rows at least, and 128 tokens: few shapes.
CONFIG = dict(num_pages=128, page_size=8, max_num_seqs=16, max_num_batched_tokens=128, min_padded_seqs=16,
              min_padded_tokens=128)  # fmt: skip


@pytest.fixture(scope="module")
def loaded(engine_llama_checkpoint):
    return models.load(engine_llama_checkpoint, require_tokenizer=False)


def _prompts() -> list[list[int]]:
    """16 prompts that repeat a phrase, so prompt lookup proposes drafts and many stand."""
    return [[3 + (7 * i + j) % 250 for j in range(2 + i % 5)] * 8 for i in range(16)]


def _run(loaded, speculative, prepare=None, mesh_shape=None) -> tuple[dict, Engine, list]:
    """Greedy outputs (tokens, logprobs) of the 16 prompts, the engine, and per step (draft rows, compiled?)."""
    engine = Engine(loaded, EngineConfig(**CONFIG, speculative_config=speculative, mesh_shape=mesh_shape))
    engine.warm_up()  # every plain (T, S) program: only speculating shapes are left to compile
    steps, run = [], engine.runner.run

    def run_noting_steps(batch, seed_of):
        rows = run(batch, seed_of)
        steps.append((sum(s.num_draft_tokens for s in rows.batch.sequences), engine.runner.last_step_compiled))
        return rows

    engine.runner.run = run_noting_steps
    if prepare is not None:
        prepare(engine)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    for index, prompt in enumerate(_prompts()):
        engine.add_request(str(index), prompt, params)
    outputs = {}
    for request_id, output in drain(engine).items():
        completion = output.outputs[0]
        pairs = zip(completion.token_ids, completion.logprobs, strict=True)
        logprobs = [entry[token].logprob for token, entry in pairs]
        outputs[request_id] = (completion.token_ids, logprobs)
    engine.scheduler.check_page_invariants()
    return outputs, engine, steps


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    """Plain decoding's outputs."""
    return _run(loaded, None)[0]


def _assert_plain_output(outputs: dict, reference: dict) -> None:
    """Plain decoding's tokens exactly, and its logprobs to f32 rounding (a speculating row computes its tokens as
    one chunk: test_speculative)."""
    assert outputs.keys() == reference.keys()
    for key, (tokens, logprobs) in reference.items():
        assert outputs[key][0] == tokens, key
        np.testing.assert_allclose(outputs[key][1], logprobs, rtol=0, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("mesh_shape", [None, "data=2,model=2"])
def test_steps_compiled_ahead_compute_what_the_jitted_steps_compute(engine_llama_checkpoint, reference, mesh_shape):
    """Every speculating shape compiled ahead (R = 16, 32, 64 draft rows) before the requests come, on one device
    and on two replicas of two model shards each: every drafting step runs an ahead program and compiles nothing,
    and the tokens and logprobs are bit for bit those of the same run with the jitted programs (and plain
    decoding's tokens)."""
    mesh = None
    if mesh_shape is not None:
        import jax

        from paxkv.parallel.mesh import make_mesh

        mesh = make_mesh(mesh_shape, jax.devices()[:4])
    loaded = models.load(engine_llama_checkpoint, mesh=mesh, require_tokenizer=False)
    jitted = _run(loaded, {**NGRAM, "adaptive": False}, mesh_shape=mesh_shape)[0]

    def compile_every_shape(engine):
        for num_drafts in (16, 32, 64):
            engine.runner.compile_ahead(16 + num_drafts, 16, False, num_drafts, True, True)  # logprobs, greedy
        assert engine.runner.ahead.wait(timeout=600)

    outputs, engine, steps = _run(loaded, {**NGRAM, "adaptive": False}, compile_every_shape, mesh_shape)
    assert outputs == jitted
    _assert_plain_output(outputs, reference)
    ahead = engine.runner.ahead
    assert ahead.num_failed == 0 and ahead.num_programs == 3 * 2  # per R: a forward and its sampling
    drafting = [compiled for num_drafts, compiled in steps if num_drafts]
    assert len(drafting) > 10 and not any(compiled for compiled in drafting)
    assert engine.runner.num_ahead_steps == len(drafting)
    assert ahead._thread is None  # the worker ends once it has nothing to compile


def test_adaptive_speculation_never_runs_a_step_it_would_compile(loaded, reference):
    """A budget that finds drafts always worth it and compiles cheap (a flat step cost, a long-lived engine): the
    shapes it wants are compiled ahead (here awaited, as if the compile were instant) and run from then on; no
    speculating step compiles, and the output is plain decoding's."""
    asked = []

    def eager_budget(engine):
        budget = engine.drafter.budget
        budget.observe_emitted(10**7)  # the work to come repays any compile
        compile_ahead = engine.drafter.compile_ahead

        def compile_now(*shape):
            asked.append(shape)
            compile_ahead(*shape)
            assert engine.runner.ahead.wait(timeout=600)

        engine.drafter.compile_ahead = compile_now

    outputs, engine, steps = _run(loaded, {**NGRAM, "adaptive": True}, eager_budget)
    _assert_plain_output(outputs, reference)
    drafting = [compiled for num_drafts, compiled in steps if num_drafts]
    assert asked and len(drafting) >= 5 and not any(drafting)
    assert engine.runner.num_ahead_steps == len(drafting)
    assert engine.metrics.num_accepted_draft_tokens > 0
