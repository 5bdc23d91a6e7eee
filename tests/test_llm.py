"""The LLM batch API on the embedded SmolLM2: chat, prompt forms, input order, bad input."""

import io

import pytest

from paxkv import LLM, SamplingParams
from paxkv.entrypoints.batch_runner import BadRequestsError, run_lines
from paxkv.entrypoints.prompts_file import PromptLine

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    # min_padded_seqs: every step pads to the 4 rows (TPU's floor of 8, capped), for fewer SmolLM2 programs.
    return LLM(num_pages=128, max_num_seqs=4, max_num_batched_tokens=128, min_padded_seqs=8)


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
    requests_before = llm.engine.metrics.num_requests
    aborted_before = llm.engine.metrics.num_aborted_requests
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(["fine", []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # Only the prefix cache still holds pages (earlier prompts' full pages), none of them in use.
    assert llm.engine.scheduler.num_used_pages == llm.engine.scheduler.prefix_tries[0].num_idle_pages()
    # "fine" was admitted, then withdrawn with the call: it leaves no trace in the metrics.
    assert llm.engine.metrics.num_requests == requests_before
    assert llm.engine.metrics.num_aborted_requests == aborted_before


def test_min_tokens_holds_back_the_end_of_turn(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    (free,) = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    assert free.outputs[0].finish_reason == "stop" and len(free.outputs[0].token_ids) < 20
    held = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    (forced,) = llm.chat(question, held, use_tqdm=False)
    assert len(forced.outputs[0].token_ids) == 20 and forced.outputs[0].finish_reason == "length"
    eos_ids = set(llm.loaded.generation_config.eos_token_ids)
    assert not eos_ids & set(forced.outputs[0].token_ids)


def test_streamed_text_never_shows_a_stop_string_that_is_cut(llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[", 5"])
    line = PromptLine(None, "count", "1, 2, 3,", None, params)
    stream = io.StringIO()
    (record,), _ = run_lines(llm.engine, [line], stream_to=stream)
    assert record["text"] == " 4" and record["finish_reason"] == "stop" and record["stop_reason"] == ", 5"
    assert stream.getvalue() == " 4\n"


def test_batch_runner_admits_all_or_nothing_unless_skipping(llm):
    good = PromptLine(1, "good", "The sky is", None, GREEDY)
    too_long = PromptLine(2, "long", "word " * 5000, None, GREEDY)
    with pytest.raises(BadRequestsError, match="line 2: .*max_model_len"):
        run_lines(llm.engine, [good, too_long], skip_bad_lines=False)
    assert not llm.engine.has_unfinished_requests()
    assert (
        llm.engine.scheduler.num_used_pages == llm.engine.scheduler.prefix_tries[0].num_idle_pages()
    )  # only cached pages
    records, _ = run_lines(llm.engine, [good, too_long], skip_bad_lines=True)
    assert records[0]["id"] == "good" and len(records[0]["token_ids"]) == 16
    assert records[1]["id"] == "long" and "max_model_len" in records[1]["error"]


def test_parallel_samples_and_prompt_dicts(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, n=3)
    (salted, by_ids) = llm.generate(
        [{"prompt": "Once upon a time", "cache_salt": "tenant-1"}, {"prompt_token_ids": [504, 3180, 314]}],
        params,
        use_tqdm=False,
    )
    assert [c.index for c in salted.outputs] == [0, 1, 2] and salted.prompt == "Once upon a time"
    assert all(len(c.token_ids) == 8 for c in salted.outputs)
    assert len({tuple(c.token_ids) for c in salted.outputs}) > 1  # seeds 3, 4, 5 sample differently
    assert by_ids.prompt_token_ids == [504, 3180, 314] and len(by_ids.outputs) == 3
    (again,) = llm.generate([{"prompt": "Once upon a time", "cache_salt": "tenant-1"}], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in salted.outputs]  # seeded: reproducible
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "hi"}], GREEDY, use_tqdm=False)
