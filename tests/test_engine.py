"""The paged engine against transformers and against itself: greedy equivalence, batch invariance, preemption."""

import numpy as np
import pytest
import torch
import transformers

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.execution.step import num_step_compilations
from paxkv.execution.step_inputs import num_buckets
from paxkv.scheduling.sampling_params import SamplingParams

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(engine_llama_checkpoint):
    """A tiny random Llama saved by transformers, and the same model loaded by paxkv."""
    torch_model = transformers.LlamaForCausalLM.from_pretrained(engine_llama_checkpoint).eval()
    return torch_model, models.load(engine_llama_checkpoint, require_tokenizer=False)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    lengths = [3, 300, 17, 64, 5, 129, 40, 1, 90, 33, 250, 8, 16, 77, 2, 180]
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def _reference(torch_model, prompt):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = torch_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is also pad_token_id: without a mask it would be masked
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _run(loaded, prompts, config, *, stagger: bool = True) -> tuple[dict[str, list[int]], Engine]:
    """Feed prompts (a few per step when staggered) and drive the engine until every request finishes."""
    engine = Engine(loaded, config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    pending = list(enumerate(prompts))
    results = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(3 if stagger else len(pending)):
            if pending:
                index, prompt = pending.pop(0)
                engine.add_request(str(index), prompt, params)
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].finish_reason == "length"
                results[output.request_id] = output.outputs[0].token_ids
    return results, engine


@pytest.mark.parametrize("token_budget", [16, 4096])
def test_greedy_equals_transformers_and_is_batch_invariant(tiny, token_budget):
    torch_model, loaded = tiny
    prompts = _prompts()
    config = EngineConfig(num_pages=400, page_size=16, max_num_seqs=8, max_num_batched_tokens=token_budget)
    before = num_step_compilations()  # the count is per process, and other tests compile too
    batched, engine = _run(loaded, prompts, config)
    assert num_step_compilations() - before <= num_buckets(token_budget) * num_buckets(8) * 2
    for index in range(len(prompts)):  # each alone: the same tokens as inside the batch
        alone, _ = _run(loaded, [prompts[index]], config)
        assert alone["0"] == batched[str(index)]
    for index, prompt in enumerate(prompts):
        assert batched[str(index)] == _reference(torch_model, prompt), index


def test_out_of_pages_preempts_and_still_matches(tiny):
    torch_model, loaded = tiny
    prompts = _prompts()
    demand = sum(-(-(len(p) + NEW_TOKENS) // 16) for p in prompts)
    # 20% of demand (94 pages) is 18 pages, too few for the 300-token prompt alone (20 pages + the null page),
    # so the pool is the smallest that can hold it: 22 pages, about 23% of demand.
    tight_config = EngineConfig(num_pages=max(22, demand // 5), max_num_seqs=8, max_num_batched_tokens=256)
    tight, engine = _run(loaded, prompts, tight_config)
    assert engine.metrics.num_preemptions > 0
    for index, prompt in enumerate(prompts):
        assert tight[str(index)] == _reference(torch_model, prompt), index


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    _, loaded = tiny
    prompts = _prompts()[:6]
    config = EngineConfig(num_pages=200, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=1.0, top_k=20, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(selected):
        engine = Engine(loaded, config)
        for index in selected:
            engine.add_request(str(index), prompts[index], params)
        return {request_id: output.outputs[0].token_ids for request_id, output in drain(engine).items()}

    together = run(range(6))
    assert run([2])["2"] == together["2"]
    assert run(range(6)) == together
    assert len({tuple(tokens) for tokens in together.values()}) > 1


def test_bad_requests_are_rejected_without_harming_others(tiny):
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(num_pages=50, max_num_seqs=4, max_model_len=128))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("good", [1, 2, 3], params)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("empty", [], params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [1, 999], params)
    with pytest.raises(ValueError, match="max_model_len is 128"):
        engine.add_request("long", list(range(200)), params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [4], params)
    finished = drain(engine)
    assert list(finished) == ["good"] and len(finished["good"].outputs[0].token_ids) == 4
