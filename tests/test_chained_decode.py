"""Chained decode passes on a real model (paxkv.execution.chained_decode): the tokens of one step per token, greedy
equal to transformers', and chains only where no caller reads outputs step by step."""

import numpy as np
import pytest
import torch
import transformers

import models
import paxkv.execution.model_runner
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.execution.chained_decode import ChainedRows, chained_decode_step
from paxkv.parallel.mesh import load_on_mesh
from paxkv.scheduling.sampling_params import SamplingParams

EOS = 2  # "</s>" in word_level_llama's vocabulary


@pytest.fixture(scope="module")
def word_model(word_level_llama):
    return models.load(word_level_llama)


def _requests():
    """(id, prompt token ids, params): greedy and seeded draws, stop tokens and strings, n = 2, uneven lengths."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 40, 17, 1, 66, 9, 23)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=1, max_tokens=25, stop=["w7", "w100 w"]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=18, n=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=40, stop_token_ids=[17, 44, 90]),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    ]
    return [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]


def _generate(loaded, requests, num_scheduler_steps, *, final_only=True, **config):
    """Every request's outputs (token ids, finish reason, text per sample) and the chain length of every step."""
    engine = Engine(
        loaded, EngineConfig(num_scheduler_steps=num_scheduler_steps, max_num_seqs=8, num_pages=256, **config)
    )
    steps = []
    schedule = engine.scheduler.schedule

    def recorded(max_decode_steps=1):
        batch = schedule(max_decode_steps)
        steps.append(batch.decode_steps)
        return batch

    engine.scheduler.schedule = recorded
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, final_only=final_only)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = [(o.token_ids, o.finish_reason, o.text) for o in output.outputs]
        engine.scheduler.check_page_invariants()
    return results, steps


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8"])
def test_chained_passes_give_the_tokens_of_single_steps(word_model, kv_cache_dtype):
    requests = _requests()
    single, single_steps = _generate(word_model, requests, 1, kv_cache_dtype=kv_cache_dtype)
    chained, chained_steps = _generate(word_model, requests, 4, kv_cache_dtype=kv_cache_dtype)
    assert chained == single
    assert set(single_steps) == {1} and max(chained_steps) == 4
    assert len(chained_steps) < len(single_steps)
    assert any(reason == "stop" for outputs in single.values() for _, reason, _ in outputs)


def test_a_stop_string_inside_a_chain_cuts_as_single_steps_do(word_model):
    prompt = list(range(60, 75))
    free = dict(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)
    ((tokens, _, text),) = _generate(word_model, [("a", prompt, SamplingParams(**free))], 1)[0]["a"]
    words = text.split()
    stop = " ".join(words[1:3])  # completed by the third token: the second pass of the first chain
    requests = [("a", prompt, SamplingParams(**free, stop=[stop]))]
    single, _ = _generate(word_model, requests, 1)
    chained, steps = _generate(word_model, requests, 4)
    assert chained == single and steps[1] == 4
    ((cut_tokens, reason, cut_text),) = chained["a"]
    assert (cut_tokens, reason, cut_text.strip()) == (tokens[:3], "stop", words[0])


def test_chained_greedy_equals_transformers(word_model, word_level_llama):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, n).tolist() for n in (3, 31, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    chained, steps = _generate(word_model, [(str(i), p, params) for i, p in enumerate(prompts)], 8)
    assert max(steps) == 8
    torch_model = transformers.LlamaForCausalLM.from_pretrained(word_level_llama).eval()
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = torch_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=11, do_sample=False, eos_token_id=None
            )
        assert chained[str(index)][0][0] == out[0, len(prompt) :].tolist()


def test_streaming_requests_never_chain(word_model):
    requests = _requests()[:3]
    streamed, steps = _generate(word_model, requests, 4, final_only=False)
    assert set(steps) == {1}
    assert streamed == _generate(word_model, requests, 4)[0]


def test_data_replicas_chain_alike(word_level_llama):
    loaded = load_on_mesh(word_level_llama, "data=2")
    requests = _requests()
    single, _ = _generate(loaded, requests, 1, mesh_shape="data=2")
    chained, steps = _generate(loaded, requests, 4, mesh_shape="data=2")
    assert chained == single and max(steps) == 4


def test_bf16_weights_chain_without_converting_the_embedding_each_run(word_level_llama, monkeypatch):
    loaded = models.load(word_level_llama, dtype="bfloat16")
    captured = []

    def capture(*args):
        captured.append(args)
        return chained_decode_step(*args)

    monkeypatch.setattr(paxkv.execution.model_runner, "chained_decode_step", capture)
    requests = _requests()[:3]
    chained, _ = _generate(loaded, requests, 4)
    monkeypatch.undo()
    assert chained == _generate(loaded, requests, 1)[0]
    # XLA:CPU gathers bf16 rows through f32; hoisted out of the loop, that conversion would run over the whole
    # table every chained step (chained_decode_step turns loop-invariant code motion off).
    embed = loaded.model.embed[...]
    embedding = getattr(embed, "panels", embed)  # a tied embedding's panels, else the table
    text = chained_decode_step.lower(*captured[0]).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    assert "f32[" + ",".join(map(str, embedding.shape)) + "]" not in entry


def _greedy_with_a_stop(loaded, prompt):
    """A prompt's first 12 greedy tokens, and a token of them first sampled at index 3 or later, to stop at."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ((tokens, _, _),) = _generate(loaded, [("a", prompt, greedy)], 1)[0]["a"]
    return tokens, next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])


def _record_chains(monkeypatch) -> list:
    """(passes run, samples) of every chained step the engine runs from now on."""
    runs = []

    def recorded(*args):
        rows = ChainedRows(*args)
        runs.append((rows.num_passes_run, list(rows.tokens)))
        return rows

    monkeypatch.setattr(paxkv.execution.model_runner, "ChainedRows", recorded)
    return runs


def test_a_chain_ends_when_every_row_has_stopped(word_model, monkeypatch):
    prompt = list(range(10, 30))
    tokens, stop = _greedy_with_a_stop(word_model, prompt)
    runs = _record_chains(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    ((stopped, reason, _),) = _generate(word_model, [("a", prompt, params)], 8)[0]["a"]
    assert (stopped, reason) == (tokens[: tokens.index(stop) + 1], "stop")
    # The prefill step samples the first token; one chain of 8 passes follows and ends at the stop token.
    ((num_run, samples),) = runs
    assert num_run == tokens.index(stop) < 8
    assert samples[:num_run] == tokens[1 : num_run + 1] and samples[num_run:] == [0] * (8 - num_run)


def test_a_row_that_stopped_keeps_no_samples_while_the_others_run(word_model, monkeypatch):
    prompt, other = list(range(10, 30)), list(range(40, 60))
    tokens, stop = _greedy_with_a_stop(word_model, prompt)
    runs = _record_chains(monkeypatch)
    stopping = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results, _ = _generate(word_model, [("a", prompt, stopping), ("b", other, greedy)], 8)
    assert results["a"][0][0] == tokens[: tokens.index(stop) + 1]
    (num_run, samples), *_ = runs
    assert num_run == 8  # "b" runs all its passes
    stopped_at = tokens.index(stop)  # a's pass that sampled the stop token, counted from 1
    assert samples[:stopped_at] == tokens[1 : stopped_at + 1] and samples[stopped_at:8] == [0] * (8 - stopped_at)


def _run_in_turn(engine, requests):
    """Runs each (id, prompt, params) to its end before adding the next; returns each one's first output."""
    results = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, final_only=True)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[request_id] = output.outputs[0]
    return results


def test_a_chain_that_stops_early_caches_only_computed_pages(word_model):
    """A row that stops mid-chain skips its later passes: the stop token's KV is never written, so the page it ends
    must not go into the prefix cache. A follow-up prompt that extends the finished request (a chat's next turn) then
    gets the logprobs it gets after single steps."""
    page_size = 8
    for length in range(20, 40):  # a prompt whose greedy run stops on a page's last slot, in a chain's middle
        prompt = list(range(10, 10 + length))
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ((tokens, _, _),) = _generate(word_model, [("a", prompt, greedy)], 1, page_size=page_size)[0]["a"]
        # Token i is sampled by the prefill (i = 0) or by pass i - 1 of the first chain of 8.
        stops = [i for i in range(2, 7) if tokens[i] not in tokens[:i] and (length + i + 1) % page_size == 0]
        if stops:
            break
    assert stops, "no prompt of 20-39 tokens stops on a page's last slot inside a chain"
    stop_index = stops[0]
    stopping = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[stop_index]])
    follow_up = prompt + tokens[: stop_index + 1] + [5, 6, 7]
    scoring = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    requests = [("first", prompt, stopping), ("next", follow_up, scoring)]
    results, cached, computed = {}, {}, {}
    for steps in (1, 8):
        engine = Engine(word_model, EngineConfig(num_scheduler_steps=steps, num_pages=64, page_size=page_size))
        first = _run_in_turn(engine, requests[:1])["first"]
        assert first.token_ids == tokens[: stop_index + 1] and first.finish_reason == "stop"
        (replica,) = engine.scheduler.replicas
        cached[steps] = len(replica.prefix_trie.match(follow_up, touch=False))
        computed[steps] = engine.metrics.num_computed_tokens
        results[steps] = _run_in_turn(engine, requests[1:])["next"]
    assert cached[8] == cached[1] == (length + stop_index) // page_size
    assert computed[8] == computed[1] == length + stop_index  # the stop token's KV is never computed
    assert results[8].token_ids == results[1].token_ids
    assert results[8].logprobs == results[1].logprobs
