"""The LLM batch API on the embedded SmolLM2: chat, prompt forms, input order, bad input."""

import pytest

from paxkv import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(num_pages=128, max_num_seqs=4, max_num_batched_tokens=128)


def test_chat_answers_paris(llm):
    (output,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in output.outputs[0].text


def test_prompt_forms_and_input_order(llm):
    prompts = ["The sky is", "1, 2, 3,", "Hello"]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    token_prompts = [o.prompt_token_ids for o in outputs]
    again = llm.generate(token_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    (single,) = llm.generate("The sky is", GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_per_prompt_params_and_stop_strings(llm):
    counting = SamplingParams(temperature=0.0, max_tokens=16, stop=[" 5"])
    short = SamplingParams(temperature=0.0, max_tokens=3)
    counted, cut = llm.generate(["1, 2, 3,", "The sky is"], [counting, short], use_tqdm=False)
    assert counted.outputs[0].text == " 4,"  # generation ran into " 5", which is cut off
    assert counted.outputs[0].finish_reason == "stop"
    assert len(cut.outputs[0].token_ids) == 3 and cut.outputs[0].finish_reason == "length"


def test_bad_prompt_fails_the_call_and_leaves_the_engine_clean(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(["fine", []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.allocator.num_used_pages == 0
