"""LLM's strict inputs: integer token ids, errors that name the prompt's position, type errors that say what was
expected, text UTF-8 cannot encode, interrupts, and weights or logits that are NaN."""

import re

import numpy as np
import pytest
import torch

import models
from models import CheckpointError
from paxkv import LLM, SamplingParams
from paxkv.scheduling.stopping import NONFINITE_REASON

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE = dict(attention_impl="xla", num_pages=32, page_size=8, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def llm(word_level_llama):
    return LLM(word_level_llama, max_model_len=128, **ENGINE)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_token_ids_must_be_integers(llm):
    for bad, shown in (([1.9, 2.0], "1.9 (float)"), (["1", "2"], "'1' (str)"), ([True, False], "True (bool)")):
        message = f"prompt 1: token id 0 is {shown}; token ids must be integers"
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([[5, 6], bad], GREEDY, use_tqdm=False)
    expected = _tokens(llm.generate([[5, 6]], GREEDY, use_tqdm=False))
    numpy_ids = llm.generate([np.array([5, 6], np.int64), [np.int32(5), np.uint8(6)]], GREEDY, use_tqdm=False)
    assert _tokens(numpy_ids) == expected * 2  # numpy integers are integers
    assert not llm.engine.has_unfinished_requests()


def test_errors_name_the_prompt_position_in_the_callers_list(llm):
    cases = [
        ([[5], [5, 999]], "prompt 1 has token ids outside the vocabulary [0, 256): [999]"),
        (["w1", "w1 " * 130], "prompt 1 has 130 prompt tokens + max_tokens 4 = 134 tokens but max_model_len is 128"),
        (["w1", "w2", []], "prompt 2 has an empty prompt; give at least one prompt token"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_wrong_container_types_say_what_was_expected(llm):
    with pytest.raises(TypeError, match=re.escape("prompts must be a string or a list of prompts (strings, token-id")):
        llm.generate(None)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "sampling_params must be a SamplingParams or a list of them (one per prompt), not dict; build one with "
            "SamplingParams(**{'temperature': 0})"
        ),
    ):
        llm.generate(["w1"], {"temperature": 0})
    with pytest.raises(TypeError, match=re.escape("prompt 1 is a float; give a string, a list of token ids or a")):
        llm.generate(["w1", 3.5])
    with pytest.raises(TypeError, match=re.escape("chat takes a conversation (a list of {'role', 'content'} dicts)")):
        llm.chat(None)


def test_text_utf8_cannot_encode_names_the_prompt_and_the_character(llm):
    message = "prompt 1: the text holds '\\ud800' at character 3, a lone surrogate that UTF-8 cannot encode"
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["w1", "w2 \ud800"], GREEDY, use_tqdm=False)


def test_an_interrupted_generate_leaves_the_llm_usable(llm, monkeypatch):
    expected = _tokens(llm.generate(["w1 w2", "w3"], GREEDY, use_tqdm=False))
    real_step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["w1 w2", "w3"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()  # the call's requests were aborted
    assert _tokens(llm.generate(["w1 w2", "w3"], GREEDY, use_tqdm=False)) == expected


@pytest.fixture(scope="module")
def nan_checkpoint(make_tiny_llama, tmp_path_factory):
    """The tiny Llama with one NaN in layer 1's MLP down projection."""
    model = make_tiny_llama(seed=3)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    path = tmp_path_factory.mktemp("nan_llama")
    model.save_pretrained(path)
    return path


def test_nonfinite_weights_are_refused_at_load_with_the_tensor_named(nan_checkpoint):
    with pytest.raises(
        CheckpointError,
        match=r"nan_llama0: weights hold NaN or Inf in layers\.1\.mlp\.down \(1 value\); the checkpoint is corrupt",
    ):
        models.load(nan_checkpoint, require_tokenizer=False)
    with pytest.raises(CheckpointError, match=re.escape("or pass allow_nonfinite_weights=True (--allow_nonfinite_")):
        models.load(nan_checkpoint, require_tokenizer=False)


def test_nonfinite_logits_finish_the_request_with_an_error_not_token_0(nan_checkpoint):
    llm = LLM(nan_checkpoint, skip_tokenizer_init=True, allow_nonfinite_weights=True, **ENGINE)
    (output,) = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "error" and completion.stop_reason == NONFINITE_REASON
    assert completion.token_ids == []
    assert not llm.engine.has_unfinished_requests()
