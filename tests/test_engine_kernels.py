"""The engine on the Pallas kernels (interpreted on CPU) gives exactly the XLA path's greedy tokens."""

import numpy as np
import pytest

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.scheduling.sampling_params import SamplingParams

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_path(engine_llama_checkpoint):
    """A tiny random Llama (4 query heads over 2 KV heads, head_dim 16) saved by transformers."""
    return engine_llama_checkpoint


def _greedy(path, attention_impl: str) -> dict[str, list[int]]:
    """8 requests of 1 to 70 tokens, arriving two per step, through chunked prefill mixed with decodes."""
    loaded = models.load(path, require_tokenizer=False, attention_impl=attention_impl)
    config = EngineConfig(
        num_pages=80, page_size=8, max_num_seqs=8, max_num_batched_tokens=32, min_padded_seqs=8, min_padded_tokens=32
    )
    engine = Engine(loaded, config)  # every step 8 rows (TPU's row floor) and 32 tokens: few programs
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 70, 9, 16, 17, 33, 5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results, pending = {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                index, prompt = pending.pop(0)
                engine.add_request(str(index), prompt, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    assert len(results) == 8
    return results


@pytest.fixture(scope="module")
def xla_tokens(tiny_path) -> dict[str, list[int]]:
    """The XLA path's greedy tokens, computed once for both kernels."""
    return _greedy(tiny_path, "xla")


@pytest.mark.parametrize("kernel", ["interpret_tpu", "interpret_gpu"])
def test_interpreted_kernels_match_xla_greedy_tokens(tiny_path, xla_tokens, kernel):
    assert _greedy(tiny_path, kernel) == xla_tokens


def test_interpret_resolves_to_the_tpu_kernel_on_cpu(tiny_path):
    loaded = models.load(tiny_path, require_tokenizer=False, attention_impl="interpret")
    assert {layer.attention.attention_impl for layer in loaded.model.layers} == {"interpret_tpu"}
