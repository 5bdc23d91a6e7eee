"""Step programs compiled on a worker thread ahead of use (paxkv.execution.ahead_compiler): a step that runs them
compiles nothing and computes what the jitted step computes, and adaptive speculation never runs a speculating
step it would have to compile."""

import numpy as np
import pytest

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.execution.step import num_step_compilations
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import SpeculatingStep

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


def _run(loaded, speculative, prepare=None, mesh_shape=None, **config) -> tuple[dict, Engine, list]:
    """Greedy outputs (tokens, logprobs) of the 16 prompts, the engine, and per step (drafts, compiled?, first run of
    an ahead-compiled program?)."""
    config = {**CONFIG, **config}
    engine = Engine(loaded, EngineConfig(**config, speculative_config=speculative, mesh_shape=mesh_shape))
    engine.warm_up()  # every plain (T, S) program: only speculating shapes are left to compile
    steps, run = [], engine.runner.run

    def run_noting_steps(batch, seed_of):
        rows = run(batch, seed_of)
        runner = engine.runner
        num_drafts = sum(s.num_draft_tokens for s in rows.batch.sequences)
        steps.append((num_drafts, runner.last_step_compiled, runner.last_step_first_run))
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

    jitted_programs = []

    def compile_every_shape(engine):
        for num_drafts in (16, 32, 64):
            engine.runner.compile_ahead(SpeculatingStep(16 + num_drafts, 16, False, num_drafts, True, True))
        assert engine.runner.ahead.wait(timeout=600)
        jitted_programs.append(num_step_compilations())

    outputs, engine, steps = _run(loaded, {**NGRAM, "adaptive": False}, compile_every_shape, mesh_shape)
    assert outputs == jitted
    # The plain steps between the drafting ones reuse the programs the warm-up compiled: a jitted step's cache keys
    # on its arguments' commitment, and the pool an ahead program returns is committed, as it was allocated.
    assert num_step_compilations() == jitted_programs[0]
    _assert_plain_output(outputs, reference)
    ahead = engine.runner.ahead
    assert ahead.num_failed == 0 and ahead.num_programs == 3 * 2  # per R: a forward and its sampling
    drafting = [compiled for num_drafts, compiled, _ in steps if num_drafts]
    # The first run of each program compiled ahead is not timed as its cost (a new executable's first run is slower).
    first_runs = sum(first_run for _, _, first_run in steps)
    assert 0 < first_runs <= 3 and not any(first_run for num_drafts, _, first_run in steps if not num_drafts)
    assert len(drafting) > 10 and not any(compiled for compiled in drafting)
    assert engine.runner.num_ahead_steps == len(drafting)
    assert ahead._thread is None  # the worker ends once it has nothing to compile


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adaptive_speculation_never_runs_a_step_it_would_compile(loaded, reference, engine_llama_checkpoint, method):
    """A budget that finds compiles cheap (a long-lived engine): the shapes it wants (a draft model's programs
    too) are compiled ahead (here awaited, as if the compile were instant) and run from then on; no speculating
    step compiles, and the output is plain decoding's."""
    asked = []

    def eager_budget(engine):
        engine.drafter.budget.observe_emitted(10**7)  # the work to come repays any compile
        compile_ahead = engine.drafter.compile_ahead

        def compile_now(step):
            asked.append(step)
            compile_ahead(step)
            assert engine.runner.ahead.wait(timeout=600)

        engine.drafter.compile_ahead = compile_now

    speculative = {**NGRAM, "adaptive": True}
    if method == "draft_model":  # the target drafting for itself: every draft stands
        speculative = {"method": "draft_model", "model": engine_llama_checkpoint, "num_speculative_tokens": 4}
    # 8 rows at a time: requests wait, so every row's drafts count in full (with none waiting, only the rows with the
    # most tokens left draft: test_draft_budget).
    outputs, engine, steps = _run(loaded, speculative, eager_budget, max_num_seqs=8, min_padded_seqs=8)
    _assert_plain_output(outputs, reference)
    drafting = [compiled for num_drafts, compiled, _ in steps if num_drafts]
    assert asked and drafting and not any(drafting)
    assert engine.runner.num_ahead_steps == len(drafting)
    assert engine.metrics.num_accepted_draft_tokens > 0
    if method == "draft_model":
        assert all(step.draft_spans for step in asked)  # what the draft runs, asked about with the target's programs
        assert engine.metrics.num_accepted_draft_tokens == engine.metrics.num_draft_tokens


def test_a_draft_models_programs_are_known_before_it_runs(loaded, engine_llama_checkpoint):
    """Before each fill, the draft programs it will run are predicted from the drafting rows' spans alone (catch-up
    programs too, where the catch-ups exceed a 64-token budget), which is what the budget asks about before it
    drafts; then, compiled ahead, those programs run without compiling."""
    from paxkv.execution.draft_proposer import last_position

    draft = {"method": "draft_model", "model": engine_llama_checkpoint, "num_speculative_tokens": 4, "adaptive": False}
    engine = Engine(loaded, EngineConfig(**{**CONFIG, "max_num_batched_tokens": 64, "min_padded_tokens": 64},
                                         speculative_config=draft))  # fmt: skip
    proposer, predictions = engine.runner.draft, []
    fill = proposer.fill

    def fill_checking_sizes(batch, kv_caches, seed_of):
        spans = [
            last_position(s) + 1 - min(s.request.num_draft_computed, last_position(s))
            for s in batch.sequences
            if s.num_draft_tokens
        ]
        predicted = proposer.program_sizes([spans])
        ahead = proposer.has_compiled([spans])
        result = fill(batch, kv_caches, seed_of)
        predictions.append((predicted, list(proposer.last_fill_sizes), ahead, proposer.last_fill_compiled))
        if spans:
            proposer.compile_ahead([spans], engine.runner.draft_layers)
            assert engine.runner.ahead.wait(timeout=600)
        return result

    proposer.fill = fill_checking_sizes
    for index, prompt in enumerate(_prompts()):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    drain(engine)
    assert all(predicted == ran for predicted, ran, _, _ in predictions)
    assert any(len(ran) > 1 for _, ran, _, _ in predictions)  # catch-up programs before a drafting one
    # A fill whose programs were known compiled (run before, or compiled ahead) compiled nothing, and every later
    # shape that had been compiled ahead ran without compiling.
    assert all(not compiled for _, _, known, compiled in predictions if known)
    assert sum(known for _, _, known, _ in predictions) > len(predictions) / 2
    assert engine.metrics.num_accepted_draft_tokens == engine.metrics.num_draft_tokens > 0
