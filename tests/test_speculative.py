"""Speculative decoding in the engine: its output, which speculation must leave exactly as it was (the n-gram index
and acceptance counts: test_ngram_and_acceptance.py; the budget's decisions: test_draft_budget.py; the scheduler's
side: test_speculative_scheduling.py)."""

import numpy as np
import pytest

import models
from paxkv.config import EngineConfig, SpeculativeConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import SpeculatingStep

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def loaded(engine_llama_checkpoint):
    return models.load(engine_llama_checkpoint, require_tokenizer=False)


@pytest.fixture(scope="module")
def truncated_draft(engine_llama_checkpoint, tmp_path_factory):
    """A draft model for the engine tests' tiny Llama: its first layer alone (with its embedding, final norm and
    lm_head), saved by transformers. It agrees with the target on a few tokens only, so its drafts are mostly
    rejected and sometimes accepted."""
    import transformers

    target = transformers.LlamaForCausalLM.from_pretrained(engine_llama_checkpoint)
    config = transformers.LlamaConfig.from_pretrained(engine_llama_checkpoint, num_hidden_layers=1)
    draft = transformers.LlamaForCausalLM(config)
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 1's weights have no place in it
    path = tmp_path_factory.mktemp("truncated_draft")
    draft.save_pretrained(path)
    return str(path)


def _draft_model(path, **overrides) -> dict:
    """A draft_model speculative config with every proposal drafted (no adaptive budget)."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, "adaptive": False, **overrides}


def _prompts() -> list[list[int]]:
    """32 prompts that repeat a phrase (so drafts come up), of mixed lengths."""
    rng = np.random.default_rng(1)
    return [(rng.integers(3, 256, int(rng.integers(3, 9))).tolist() * 12)[: int(n)] for n in rng.integers(2, 70, 32)]


def _greedy(index: int) -> SamplingParams:
    """Greedy, with max_tokens from 9 to 24 so the length limit often falls inside an accepted draft."""
    return SamplingParams(temperature=0.0, max_tokens=9 + index % 16, ignore_eos=True, logprobs=1)


def _assert_same_output(speculated: dict, plain: dict, num_prompts: int = 32) -> None:
    """The same tokens and finish reasons exactly; logprobs to f32 rounding, since a speculating row computes its
    tokens as one chunk (the chunked attention path) where plain decoding computes them one by one (measured: at
    most 1.5e-6 apart). Never a 0.0 placeholder: this model's logprobs are all far below 0."""
    plain = {key: value for key, value in plain.items() if int(key[0]) < num_prompts}  # a shorter run's share
    assert speculated.keys() == plain.keys()
    for key, (tokens, logprobs, reason) in plain.items():
        assert (speculated[key][0], speculated[key][2]) == (tokens, reason), key
        np.testing.assert_allclose(speculated[key][1], logprobs, rtol=0, atol=1e-5, err_msg=str(key))
        assert max(speculated[key][1]) < -0.01, key


def _generate(loaded, speculative, params=_greedy, num_prompts: int = 32, prepare=None, **config):
    """The first `num_prompts` prompts' (tokens, logprobs, finish reason) and the engine that made them.

    Args:
      params: prompt index -> its SamplingParams.
      prepare: called with the engine before the requests are added, or None.
    """
    # 64 pages are too few for 16 requests at their longest: some are preempted. Steps pad to 16 rows (and draft rows)
    # and 128 tokens, for fewer programs to compile (smaller steps: test_engine; row floors below the row count: the
    # tests below).
    defaults = {
        "num_pages": 64,
        "page_size": 8,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 128,
        "min_padded_seqs": 16,
        "min_padded_tokens": 128,
    }
    engine = Engine(loaded, EngineConfig(**{**defaults, **config}, speculative_config=speculative))
    if prepare is not None:
        prepare(engine)
    for index, prompt in enumerate(_prompts()[:num_prompts]):
        engine.add_request(str(index), prompt, params(index))
    results = {}
    for request_id, output in drain(engine).items():
        for completion in output.outputs:
            pairs = zip(completion.token_ids, completion.logprobs, strict=True)
            logprobs = [entry[token].logprob for token, entry in pairs]
            results[request_id, completion.index] = (completion.token_ids, logprobs, completion.finish_reason)
    engine.scheduler.check_page_invariants()
    return results, engine


@pytest.fixture(scope="module")
def greedy_reference(loaded) -> dict:
    """Plain decoding's greedy output, which no batching, pool size or mesh changes (test_engine's invariance)."""
    return _generate(loaded, None)[0]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_output_is_unchanged_by_speculation(loaded, greedy_reference, preemption_mode):
    """Prefix caching on, drafts accepted and rejected, length limits inside accepted drafts, and requests preempted
    (by recompute or by swap) while they speculate: the same tokens and logprobs, every page accounted for, and no
    more programs than the buckets allow."""
    speculated, engine = _generate(loaded, {**NGRAM, "adaptive": False}, preemption_mode=preemption_mode)
    _assert_same_output(speculated, greedy_reference)
    metrics = engine.metrics
    assert 0 < metrics.num_accepted_draft_tokens < metrics.num_draft_tokens
    # Per position: every speculating row-step drafted at place 0; the counts add up to the totals.
    assert metrics.drafted_by_position[0] == metrics.num_speculative_rows > 0
    assert sum(metrics.drafted_by_position) == metrics.num_draft_tokens
    assert sum(metrics.accepted_by_position) == metrics.num_accepted_draft_tokens
    assert metrics.num_rejected_draft_tokens == metrics.num_draft_tokens - metrics.num_accepted_draft_tokens
    summary = metrics.as_dict()
    assert summary["mean_accepted_length"] == metrics.num_accepted_draft_tokens / metrics.num_speculative_rows
    assert len(summary["acceptance_by_position"]) == NGRAM["num_speculative_tokens"]
    preempted = metrics.num_preemptions_swap if preemption_mode == "swap" else metrics.num_preemptions_recompute
    assert preempted > 0 and metrics.num_preemptions == preempted
    assert engine.num_compilations <= engine.max_step_programs
    # Rows and draft rows both pad to the floor of 16 (min_padded_seqs): (T, S, ..., R) with S 16, and R when any
    # at least 16 (a draft row per drafted token: up to 4 a row).
    shapes = engine.runner.step_shapes
    assert {s[1] for s in shapes} == {16} and min(s[-1] for s in shapes if s[-1]) == 16
    # The runner knows which programs it has (what the adaptive budget asks before a step would compile one): every
    # draft-row bucket it ran, and not one it never did (up to 4 drafts on each of 16 rows: never 128).
    draft_row_buckets = {s[-1] for s in shapes}
    assert all(
        engine.runner.has_compiled(SpeculatingStep(5 + r, 5, False, r, True, True)) for r in draft_row_buckets if r
    )
    assert 128 not in draft_row_buckets and not engine.runner.has_compiled(
        SpeculatingStep(5 + 128, 5, False, 128, True, True)
    )
    assert not engine.runner.has_compiled(
        SpeculatingStep(5 + 16, 5, False, 16, False, False)
    )  # a sampling variant never run


def test_a_draft_model_leaves_greedy_output_unchanged_through_preemption_by_swap(
    loaded, greedy_reference, truncated_draft
):
    """A draft model (the target's first layer) drafting for 32 prompts, preempted by swap, prefix caching on: the
    same tokens and logprobs, drafts both accepted and rejected, every page accounted for."""
    speculated, engine = _generate(loaded, _draft_model(truncated_draft), preemption_mode="swap")
    _assert_same_output(speculated, greedy_reference)
    metrics = engine.metrics
    assert 0 < metrics.num_accepted_draft_tokens < metrics.num_draft_tokens
    assert metrics.num_preemptions_swap > 0
    # The draft's layers ride in the target's pages: the pool holds both, page for page.
    assert len(engine.kv_caches) == loaded.config.num_layers + 1
    assert engine.kv_caches[-1].shape[0] == engine.kv_caches[0].shape[0]


def test_the_target_as_its_own_draft_has_every_draft_accepted(engine_llama_checkpoint, loaded, greedy_reference):
    """Drafting with the target's own weights, every draft is the target's next token, and so stands, if and only if
    the draft's KV covers exactly the tokens the target's does: caught up over whole prompts at a request's first
    draft, through preemption by recompute, prefix-cache hits and rolled-back positions."""
    speculated, engine = _generate(loaded, _draft_model(engine_llama_checkpoint), preemption_mode="recompute")
    _assert_same_output(speculated, greedy_reference)
    metrics = engine.metrics
    assert metrics.num_draft_tokens > 200 and metrics.num_accepted_draft_tokens == metrics.num_draft_tokens
    assert metrics.num_preemptions_recompute > 0
    # Four prompts fit the same pool whole, and their full pages then serve the same prompts again, the draft's KV
    # in them too: the draft catches up over less than the prompts (the same pool shape: the programs above serve
    # this run too).
    _, engine = _generate(loaded, _draft_model(engine_llama_checkpoint), num_prompts=4)
    assert engine.metrics.num_preemptions == 0
    caught_up = engine.runner.draft.num_catch_up_tokens
    prompts = _prompts()[:4]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"again{index}", prompt, _greedy(index))
    again = {key: output.outputs[0].token_ids for key, output in drain(engine).items()}
    assert again == {f"again{i}": greedy_reference[str(i), 0][0] for i in range(4)}
    metrics = engine.metrics
    assert metrics.prefix_hit_tokens > 0 and metrics.num_accepted_draft_tokens == metrics.num_draft_tokens
    caught_up = engine.runner.draft.num_catch_up_tokens - caught_up
    assert caught_up <= sum(len(prompt) for prompt in prompts) - metrics.prefix_hit_tokens


def _skipping_drafts(plain_steps: int, starts: list, skip_catch_up: bool = False):
    """A `prepare` for _generate: the budget drafts nothing in its first `plain_steps` calls and in every third after
    them; `starts` gets, per step before it, the draft programs run so far, and per drafting row (request id, where
    the draft's KV reaches, its last token's position); with `skip_catch_up`, the draft runs from each row's last
    token as if its KV were complete (a control)."""

    def prepare(engine):
        allot, proposer = engine.drafter.budget.allot, engine.runner.draft
        fill, calls = proposer.fill, []

        def allot_skipping(*args, **kwargs):
            counts = allot(*args, **kwargs)
            calls.append(proposer.num_drafting_programs + proposer.num_catch_up_programs)
            skip = len(calls) <= plain_steps or len(calls) % 3 == 0
            return [0] * len(counts) if skip else counts

        def fill_noting_starts(batch, kv_caches, seed_of):
            for sequence in batch.sequences:
                if sequence.num_draft_tokens:
                    request = sequence.request
                    if skip_catch_up:
                        request.num_draft_computed = sequence.positions[0]
                    starts.append((request.request_id, request.num_draft_computed, sequence.positions[0]))
            return fill(batch, kv_caches, seed_of)

        engine.drafter.budget.allot, proposer.fill = allot_skipping, fill_noting_starts
        engine.programs_before_step = calls

    return prepare


def test_a_draft_model_runs_only_when_a_row_drafts_and_then_catches_up(
    engine_llama_checkpoint, loaded, greedy_reference
):
    """While the budget drafts nothing (as adaptive speculation does where drafts do not pay), no draft program runs
    at all; a row that then drafts catches the draft up over every token it skipped (its prompt, its plain decoding
    steps), in catch-up programs of their own where that exceeds the step's token budget. Drafting with the target's
    own weights, every draft stands only if that caught-up KV is exactly the target's (preemption by swap here; by
    recompute, prefix-cache hits: the test below), which the control without catch-up shows."""
    plain_steps, starts = 12, []
    draft = _draft_model(engine_llama_checkpoint)
    budget = {"max_num_batched_tokens": 64, "min_padded_tokens": 64}  # prompts of up to 69 tokens exceed it
    prepare = _skipping_drafts(plain_steps, starts)
    speculated, engine = _generate(loaded, draft, prepare=prepare, preemption_mode="swap", **budget)
    _assert_same_output(speculated, greedy_reference)
    proposer, metrics, prompts = engine.runner.draft, engine.metrics, _prompts()
    assert engine.programs_before_step[plain_steps] == 0  # none in the plain steps
    assert metrics.num_draft_tokens > 60 and metrics.num_accepted_draft_tokens == metrics.num_draft_tokens
    assert metrics.num_preemptions_swap > 0
    # A request's first draft comes from a draft that never ran for it, some after plain decoding steps; later ones
    # after the skipped steps catch up over a few tokens. Some catch-ups take programs of their own.
    first = {}
    for request_id, start, last in starts:
        first.setdefault(request_id, (start, last))
    assert len(first) > 16 and all(start == 0 for start, _ in first.values())
    assert any(last > len(prompts[int(i)]) for i, (_, last) in first.items())
    assert any(0 < start < last for _, start, last in starts)
    assert proposer.num_catch_up_programs > 0 and proposer.num_drafting_programs < metrics.num_steps

    # The control: the same schedule with the draft run from each row's last token alone.
    _, control = _generate(loaded, draft, prepare=_skipping_drafts(plain_steps, [], skip_catch_up=True), **budget)
    assert control.metrics.num_accepted_draft_tokens < 0.8 * control.metrics.num_draft_tokens


def test_forked_samples_catch_the_draft_up_over_their_shared_prompt(engine_llama_checkpoint, loaded):
    """n = 2: the samples share their prompt's pages (forked before any drafted, so each catches the draft up over
    them), and the target as its own draft still has every draft accepted."""

    def two_samples(index: int) -> SamplingParams:
        return SamplingParams(n=2, temperature=0.9, seed=index, max_tokens=12, ignore_eos=True, logprobs=0)

    _, engine = _generate(loaded, _draft_model(engine_llama_checkpoint), two_samples, num_prompts=6)
    metrics = engine.metrics
    assert metrics.num_draft_tokens > 40 and metrics.num_accepted_draft_tokens == metrics.num_draft_tokens


def test_the_target_as_its_own_draft_has_every_sampled_draft_accepted(engine_llama_checkpoint, loaded):
    """Sampled drafts (top-p, a seed per request) are drawn with the key the target samples their position with: a
    draft model equal to the target draws the target's own samples, so every draft stands where a greedy draft
    would stand only when the sample happened to be the argmax."""

    def sampled(index: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=index, max_tokens=12, ignore_eos=True, logprobs=0)

    # A floor of 3 rows rounds up to 4, for rows and for draft rows alike.
    draft = _draft_model(engine_llama_checkpoint, num_speculative_tokens=2)  # 1 row drafting: R = 2, padded to 4
    _, engine = _generate(loaded, draft, sampled, num_prompts=6, min_padded_seqs=3)
    metrics = engine.metrics
    assert metrics.num_draft_tokens > 20 and metrics.num_accepted_draft_tokens == metrics.num_draft_tokens
    padded_rows = {s[1] for s in engine.runner.step_shapes} | {s[-1] for s in engine.runner.step_shapes if s[-1]}
    assert min(padded_rows) == 4 and all(n & (n - 1) == 0 for n in padded_rows), padded_rows


def test_seeded_samples_and_an_8_bit_pool_are_unchanged_by_speculation(loaded, truncated_draft):
    """Sampling (top-p, a seed per request) with n = 2 forks sharing pages by copy-on-write, over an int8 pool."""

    def sampled(index: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=index, max_tokens=12, ignore_eos=True, logprobs=1, n=2)

    config = dict(kv_cache_dtype="int8", num_prompts=6)
    plain, _ = _generate(loaded, None, sampled, **config)
    for speculative in ({**NGRAM, "adaptive": False}, _draft_model(truncated_draft)):
        speculated, engine = _generate(loaded, speculative, sampled, **config)
        _assert_same_output(speculated, plain, num_prompts=6)
        assert engine.metrics.num_draft_tokens > 0, speculative


def test_speculation_from_the_python_api(engine_llama_checkpoint):
    """LLM(..., speculative_config=...) as vLLM spells it; a bad config names the problem."""
    from paxkv import LLM

    llm = LLM(engine_llama_checkpoint, skip_tokenizer_init=True, num_pages=64, speculative_config=NGRAM)
    assert llm.engine.config.speculative_config == SpeculativeConfig(**NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (output,) = llm.generate([_prompts()[0]], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 12
    with pytest.raises(ValueError, match="unknown keys \\['num_tokens'\\]"):
        EngineConfig(speculative_config={"method": "ngram", "num_tokens": 3})
    with pytest.raises(ValueError, match="'draft_model' needs the draft's checkpoint: give model=PATH"):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="only used by method='draft_model', not 'ngram'"):
        EngineConfig(speculative_config={**NGRAM, "model": "x"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="do not fit one step of max_num_batched_tokens=4; lower num_speculative"):
        EngineConfig(max_num_batched_tokens=4, speculative_config=NGRAM)


def test_a_draft_model_that_cannot_draft_is_refused_with_the_fix(loaded, tiny_llama_checkpoint, tmp_path):
    """Another vocabulary, a missing checkpoint, a shorter context and a pool too small with the draft's KV beside
    the target's each raise a ValueError that names the fix, before any request runs."""
    cases = [
        (_draft_model(tiny_llama_checkpoint(vocab_size=16)), {}, "vocabulary of 16 tokens and the target 256"),
        (_draft_model(tmp_path / "missing"), {}, "speculative draft model .*missing"),
        (_draft_model(tiny_llama_checkpoint()), {}, "context of 128 tokens, shorter than max_model_len=512"),
        (_draft_model(tiny_llama_checkpoint()), {"max_model_len": 128, "num_pages": 4}, "holds the draft model's KV"),
    ]
    for speculative, config, message in cases:
        with pytest.raises(ValueError, match=message):
            Engine(loaded, EngineConfig(**config, speculative_config=speculative))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_stop_string_inside_the_accepted_drafts_ends_the_text_where_plain_decoding_does(word_level_llama, method):
    """A stop string completed by an accepted draft cuts the text and drops the step's later tokens, as plain
    decoding, which never sampled them, would have it (the draft model is the target itself: every draft stands)."""
    loaded = models.load(word_level_llama)
    prompt = ([233, 130, 156, 248, 187] * 7)[:32]  # greedy continues 218 51 218 93, then 223 over and over
    stop = " ".join([loaded.tokenizer.decode([223])] * 5)

    def run(speculative):
        engine = Engine(loaded, EngineConfig(num_pages=64, page_size=8, speculative_config=speculative))
        cuts = []
        stop_at_string = engine.scheduler.stop_at_string
        engine.scheduler.stop_at_string = lambda request, stop, num_output_tokens=None: (
            cuts.append(num_output_tokens),
            stop_at_string(request, stop, num_output_tokens),
        )
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
        engine.add_request("r", prompt, params)
        completion = drain(engine)["r"].outputs[0]
        engine.scheduler.check_page_invariants()
        return (completion.text, completion.token_ids, completion.finish_reason, completion.stop_reason), cuts

    plain, plain_cuts = run(None)
    speculated, cuts = run({**NGRAM, "adaptive": False} if method == "ngram" else _draft_model(word_level_llama))
    assert plain[1] == [218, 51, 218, 93, 223, 223, 223, 223, 223] and plain[2:] == ("stop", stop)
    assert speculated == plain
    assert plain_cuts == [None] and cuts == [9]  # the step had drafts after the ninth token: they were dropped


def test_speculation_on_two_data_replicas(engine_llama_checkpoint, greedy_reference):
    """Each replica drafts and rolls back in its own pages; the output equals one device's without drafts."""
    import jax

    from paxkv.parallel.mesh import make_mesh

    mesh = make_mesh("data=2,model=1", jax.devices()[:2])
    replicated = models.load(engine_llama_checkpoint, mesh=mesh, require_tokenizer=False)
    for speculative in ({**NGRAM, "adaptive": False}, _draft_model(engine_llama_checkpoint)):
        speculated, engine = _generate(replicated, speculative, num_prompts=6, mesh_shape="data=2,model=1")
        _assert_same_output(speculated, greedy_reference, num_prompts=6)
        metrics = engine.metrics
        assert engine.pool.num_replicas == 2 and metrics.num_accepted_draft_tokens > 0, speculative
        if speculative["method"] == "draft_model":  # the target drafting for itself, each replica caught up
            assert metrics.num_accepted_draft_tokens == metrics.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_after_rejected_drafts_follow_the_models_distribution(tiny_llama_checkpoint, method):
    """1000 seeded samples after a fixed prefix, on a 16-token vocabulary and near-uniform logits, so many drafts for
    the second token are rejected: its empirical distribution matches the model's own p(t2) = sum over t1 of
    p(t1) p(t2 | t1) by a chi-square test at significance 0.001 (and so does t1's). The draft model is another random
    model of the same vocabulary: its draws, coupled with the target's, agree with them about a third of the time."""
    from scipy import stats

    vocab = 16
    loaded = models.load(tiny_llama_checkpoint(vocab_size=vocab, initializer_range=0.2), require_tokenizer=False)
    draft = tiny_llama_checkpoint(seed=1, vocab_size=vocab, initializer_range=0.2)
    speculative = {**NGRAM, "adaptive": False} if method == "ngram" else _draft_model(draft)
    prefix = list(range(vocab)) * 2  # every token recurs, so prompt lookup always drafts the second token
    # Room for the drafts beside 128 prompt tails; a draft model first catches each row up over its 33 tokens, all
    # 128 rows in the step after their prompts (Drafter.choose keeps a step's catch-ups within the token budget).
    budget = 1024 if method == "ngram" else 8192
    engine = Engine(
        loaded,
        EngineConfig(
            num_pages=512,  # two pages a request: its own prompt tail and its output
            page_size=8,
            max_num_seqs=128,
            max_num_batched_tokens=budget,
            min_padded_seqs=128,  # every step of 128 rows and the whole budget: 2 programs to compile, not 14
            min_padded_tokens=budget,
            speculative_config=speculative,
        ),
    )
    num_samples = 1000
    for seed in range(num_samples):
        # Three tokens, so the second is drafted (the step after the first verifies a draft for it).
        engine.add_request(str(seed), prefix, SamplingParams(temperature=1.0, seed=seed, max_tokens=3, ignore_eos=True))
    outputs = drain(engine)
    pairs = np.array([outputs[str(seed)].outputs[0].token_ids[:2] for seed in range(num_samples)])  # [N, 2]
    metrics = engine.metrics
    assert metrics.num_draft_tokens >= num_samples
    acceptance = metrics.num_accepted_draft_tokens / metrics.num_draft_tokens
    # Prompt lookup's point mass on one of 16 near-uniform tokens is mostly rejected; the other model's coupled
    # draws (measured 31%) are accepted and rejected often enough that both branches feed the counts below.
    assert acceptance < 0.2 if method == "ngram" else 0.15 < acceptance < 0.85

    def probabilities(tokens):
        logits = np.asarray(loaded.score(tokens)[-1], np.float64)
        return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()

    first = probabilities(prefix)  # p(t1)
    second = sum(first[t] * probabilities(prefix + [t]) for t in range(vocab))  # p(t2)
    for observed, expected in ((pairs[:, 0], first), (pairs[:, 1], second)):
        counts, expected = np.bincount(observed, minlength=vocab), expected * num_samples
        rare = expected < 5  # pooled into one cell, as the test's approximation needs
        if rare.any():
            counts = np.append(counts[~rare], counts[rare].sum())
            expected = np.append(expected[~rare], expected[rare].sum())
        assert stats.chisquare(counts, expected).pvalue > 1e-3
