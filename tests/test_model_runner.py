"""ModelRunner on its own: the StepBatch it lays out, the rows it returns, and the page moves it makes first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.execution.aot import step_buckets
from paxkv.execution.kv_pool import KVPool
from paxkv.execution.model_runner import ModelRunner
from paxkv.execution.step import num_step_compilations, static_graph
from paxkv.execution.step_inputs import NO_PADDING, StepPadding, padded_sizes, prefill_bucket
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduler import Scheduler


@pytest.fixture(scope="module")
def parts(tiny_llama_checkpoint):
    loaded = models.load(tiny_llama_checkpoint(), require_tokenizer=False)
    config = EngineConfig(page_size=8, num_pages=32, max_num_seqs=4, max_num_batched_tokens=64)
    pool = KVPool(loaded.config, config, jnp.float32, None)
    policy = PreemptionPolicy("recompute", pool.bytes_per_page, 0)
    runner = ModelRunner(loaded, pool, policy, config, max_model_len=64, mesh=None)
    scheduler = Scheduler(
        num_replicas=1, pages_per_replica=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )
    return loaded, pool, runner, scheduler


def test_a_batch_becomes_one_step_with_a_replica_axis_and_one_row_per_sequence(parts):
    loaded, pool, runner, scheduler = parts
    for index, length in enumerate([5, 11]):
        scheduler.add_request(Request(f"r{index}", list(range(1, length + 1)), SamplingParams(temperature=0.0)))
    batch = scheduler.schedule()
    step_batch, with_logprobs = runner.step_batch(batch, lambda request_id: 0)
    assert step_batch.num_replicas == 1 and not with_logprobs
    assert step_batch.inputs.tokens.shape == (1, 16)  # 16 tokens in the T bucket of 16
    assert step_batch.inputs.metadata.block_tables.shape == (1, 2, 8)  # S = 2 rows, 64 / 8 pages each
    assert step_batch.token_counts is None and step_batch.suppress is None  # compiled away
    sampled = runner.run(batch, lambda request_id: 0)
    assert sampled.tokens.shape == (2,)
    assert runner.step_shapes == {(16, 2, False, False, False, True, 0)}  # all greedy, no draft rows
    # Greedy tokens are the model's own argmax after each prompt.
    for row, length in enumerate([5, 11]):
        logits = loaded.score(list(range(1, length + 1)))
        assert int(sampled.tokens[row]) == int(np.argmax(logits[-1]))


def test_page_copies_happen_before_the_step(parts):
    _, pool, runner, _ = parts
    pool.kv_caches = [layer.at[3].set(7.0) for layer in pool.kv_caches]
    runner.move_pages(_Moves(page_copies=[(3, 9)]))
    for layer in pool.kv_caches:
        assert float(jnp.min(layer[9])) == 7.0 == float(jnp.max(layer[9]))


class _Moves:
    """A batch that only moves pages."""

    def __init__(self, page_copies=(), swap_out=(), swap_in=()):
        self.page_copies, self.swap_out, self.swap_in = list(page_copies), list(swap_out), list(swap_in)


def _warm_runner(loaded, **overrides) -> tuple[ModelRunner, KVPool]:
    """A runner over a fresh 32-page pool (4 rows, 32 tokens a step), warmed up."""
    config = EngineConfig(page_size=8, num_pages=32, max_num_seqs=4, max_num_batched_tokens=32, **overrides)
    pool = KVPool(loaded.config, config, jnp.float32, None)
    runner = ModelRunner(
        loaded, pool, PreemptionPolicy("recompute", pool.bytes_per_page, 0), config, max_model_len=64, mesh=None
    )
    assert runner.warm_up() == len(runner.step_shapes)  # one run per step shape
    return runner, pool


def _tokens_after_warm_up(runner: ModelRunner, temperature: float = 0.0) -> dict[str, list[int]]:
    """Prefills and decodes of three requests (4 new tokens each, greedy or drawn at `temperature` with seed 0);
    every step must reuse a warmed-up program."""
    before = num_step_compilations()
    scheduler = Scheduler(
        num_replicas=1, pages_per_replica=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
    )
    for index, length in enumerate([3, 9, 20]):
        scheduler.add_request(
            Request(f"r{index}", list(range(1, length + 1)), SamplingParams(temperature=temperature, max_tokens=4))
        )
    tokens = {f"r{index}": [] for index in range(3)}
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        sampled = runner.run(batch, lambda request_id: 0)
        assert not runner.last_step_compiled
        emitted = {
            s.request.request_id: int(sampled.tokens[i]) for i, s in enumerate(batch.sequences) if s.completes_prompt
        }
        for request_id, token in emitted.items():
            tokens[request_id].append(token)
        scheduler.update(batch, emitted)
    assert num_step_compilations() == before
    return tokens


def test_warm_up_compiles_every_plain_bucket_so_steps_compile_nothing(tiny_llama_checkpoint):
    """warm_up runs each (T, S) bucket once on padding (the null page only): afterwards a mix of prefills and
    decodes compiles no program, and the pages the warm-up touched are only the null page."""
    loaded = models.load(tiny_llama_checkpoint(), require_tokenizer=False)
    runner, pool = _warm_runner(loaded)
    assert runner.padding == StepPadding.for_platform("cpu") == StepPadding(min_seqs=1, min_tokens=1)
    # Every bucket's greedy step, and for each S bucket one step whose sampling draws.
    greedy, drawing = ({s[:2] for s in runner.step_shapes if s[5] == g} for g in (True, False))
    assert greedy == set(step_buckets(32, 4)) and len(greedy) == len(runner.step_shapes) - len(drawing)
    assert sorted(s for _, s in drawing) == sorted({s for _, s in step_buckets(32, 4)})
    for layer in pool.kv_caches:
        assert float(jnp.max(jnp.abs(layer[1:]))) == 0.0  # only the null page was written
    reference = _tokens_after_warm_up(runner)
    assert all(len(tokens) == 4 for tokens in reference.values())
    drawn = _tokens_after_warm_up(runner, temperature=5.0)  # the draws' sampling programs were warmed up too
    assert all(len(tokens) == 4 for tokens in drawn.values()) and drawn != reference
    # A row floor (TPU's default is 8; here 3, rounded up to 4 = max_num_seqs): every step pads to S = 4 rows,
    # three programs cover every step, and the tokens are the unpadded runner's.
    assert StepPadding.for_platform("tpu") == StepPadding(min_seqs=8, min_tokens=1)
    floored, _ = _warm_runner(loaded, min_padded_seqs=3)
    assert step_buckets(32, 4, StepPadding(min_seqs=3)) == [(4, 4), (16, 4), (32, 4)]
    assert sorted({s[:2] for s in floored.step_shapes}) == [(4, 4), (16, 4), (32, 4)]
    assert _tokens_after_warm_up(floored) == reference
    assert _tokens_after_warm_up(floored, temperature=5.0) == drawn
    assert {shape[1] for shape in floored.step_shapes} == {4}
    with pytest.raises(ValueError, match="min_padded_seqs must be a positive integer"):
        EngineConfig(min_padded_seqs=0)
    # A token floor of the whole budget: one T bucket, one program per row bucket, and still the same tokens.
    token_floored, _ = _warm_runner(loaded, min_padded_tokens=32)
    assert step_buckets(32, 4, StepPadding(min_tokens=32)) == [(32, 1), (32, 2), (32, 4)]
    assert sorted({s[:2] for s in token_floored.step_shapes}) == [(32, 1), (32, 2), (32, 4)]
    assert _tokens_after_warm_up(token_floored) == reference
    # Both floors: decodes of 4 rows pad to 8 tokens, prefills to 16 or more.
    assert step_buckets(32, 4, StepPadding(min_seqs=4, min_tokens=8)) == [(8, 4), (16, 4), (32, 4)]
    with pytest.raises(ValueError, match="min_padded_tokens must be a positive integer"):
        EngineConfig(min_padded_tokens=0)


def test_prefill_steps_pad_to_powers_of_two_and_the_half_steps_between():
    """Prefill steps pad to 1.5 times a power of two from 96 tokens up, decode steps (drafts too) to powers of two;
    each budget's largest prefill is its own size rounded up the same way."""
    sizes = [prefill_bucket(n, 2048) for n in (1, 16, 17, 64, 65, 96, 97, 128, 129, 193, 257, 1537, 4000)]
    assert sizes == [1, 16, 32, 64, 96, 96, 128, 128, 192, 256, 384, 2048, 2048]
    assert (prefill_bucket(90, 90), prefill_bucket(300, 256), prefill_bucket(300, 300)) == (96, 256, 384)
    assert padded_sizes(180, 2, True, 512, 8) == (192, 2)  # a prompt of 179 tokens beside a decode
    assert padded_sizes(72, 8, False, 512, 8) == (128, 8)  # 8 decodes with 64 drafts
    assert StepPadding().token_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]
    assert StepPadding(min_tokens=80).token_buckets(300) == [96, 128, 192, 256, 384, 512]


@pytest.mark.parametrize(
    "budget, max_num_seqs, padding",
    [(256, 32, NO_PADDING), (300, 8, NO_PADDING), (90, 16, StepPadding(min_seqs=4)), (512, 4, StepPadding(3, 80))],
)
def test_every_plain_step_pads_to_a_bucket_the_warm_up_compiles(budget, max_num_seqs, padding):
    """Every decode (T = S) and prefill (T > S) step pads to a (T, S) that step_buckets lists, the warm-up compiles,
    and whose T is among the token buckets that the scheduler fits steps to; and each listed pair is taken."""
    buckets, sizes = set(step_buckets(budget, max_num_seqs, padding)), set(padding.token_buckets(budget))
    taken = set()
    for num_seqs in range(1, max_num_seqs + 1):
        for num_tokens in range(num_seqs, budget + 1):
            shape = padded_sizes(num_tokens, num_seqs, num_tokens > num_seqs, budget, max_num_seqs, padding)
            assert shape in buckets and shape[0] in sizes, (num_tokens, num_seqs, shape)
            taken.add(shape)
    assert taken == buckets


def test_a_token_floor_leaves_the_steps_above_it_untrimmed(engine_llama_checkpoint):
    """The scheduler fits a step to the size below it only where the runner pads to that size: 260 prompt tokens run
    as 256 + 4 without a token floor (not padded to 384), and in one step with a floor of 512 (they pad to 512 either
    way)."""
    loaded = models.load(engine_llama_checkpoint, require_tokenizer=False)
    for floor, steps in ((1, 3), (512, 2)):
        config = EngineConfig(num_pages=64, max_num_seqs=4, max_num_batched_tokens=512, min_padded_tokens=floor)
        engine = Engine(loaded, config)
        prompt = [1 + i % 250 for i in range(260)]
        engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        drain(engine)
        assert engine.metrics.num_steps == steps, floor  # the prompt in 2 steps or in 1, then one decode
    assert engine.runner.padding.token_buckets(512) == [512] and StepPadding().token_buckets(4) == [1, 2, 4]


def test_engines_over_equal_models_share_the_static_graph_and_its_programs(tiny_llama_checkpoint):
    # The steps take the weights as the state's flat leaves, the state's structure held by the static argument: two
    # loads of one checkpoint share it (and the compiled programs), and the module it rebuilds holds those leaves.
    first, second = (models.load(tiny_llama_checkpoint(), require_tokenizer=False) for _ in range(2))
    config = EngineConfig(page_size=8, num_pages=32, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens, compiled = [], []
    for loaded in (first, second):
        engine = Engine(loaded, config)
        engine.add_request("a", [3, 1, 4, 1, 5], params)
        before = num_step_compilations()
        tokens.append(drain(engine)["a"].outputs[0].token_ids)
        compiled.append(num_step_compilations() - before)
    graph = static_graph(first.graphdef, first.state)
    assert graph is static_graph(second.graphdef, second.state)
    assert compiled[0] > 0 and compiled[1] == 0 and tokens[0] == tokens[1]
    weights = jax.tree.leaves(first.state)
    rebuilt = jax.tree.leaves(nnx.state(graph.model(weights)))
    assert len(rebuilt) == len(weights) and all(a is b for a, b in zip(rebuilt, weights, strict=True))
