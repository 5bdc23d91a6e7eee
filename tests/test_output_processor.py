"""OutputProcessor on its own: seeds, streamed text, stop strings reported to the scheduler, stop tokens left out."""

import numpy as np

from paxkv.core.output_processor import OutputProcessor
from paxkv.execution.step import SampledTokens
from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams

EOS = 0


class LetterTokenizer:
    """Token t is the letter chr(ord('a') + t - 1); token 0 is EOS (no text)."""

    class Detokenizer:
        def step(self, token_id: int) -> str:
            return chr(ord("a") + token_id - 1) if token_id else ""

        def flush(self) -> str:
            return ""

    def detokenizer(self):
        return self.Detokenizer()

    def decode(self, token_ids):
        return "".join(self.Detokenizer().step(t) for t in token_ids)


def _setup(params: SamplingParams, seed: int = 0):
    scheduler = ReplicaScheduler(
        PageAllocator(16),
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=32,
        eos_token_ids=[EOS],
    )
    processor = OutputProcessor(LetterTokenizer(), [EOS], seed)
    request = Request("r", [1, 2, 3], params)
    scheduler.add_request(request)
    processor.add(request, "abc")
    return scheduler, processor, request


def _step(scheduler, processor, token_id: int):
    """One step of the request with `token_id` sampled; returns its output."""
    batch = scheduler.schedule()
    new_tokens = {s.request.request_id: token_id for s in batch.sequences if s.completes_prompt}
    outcome = scheduler.update(batch, new_tokens)
    sampled = SampledTokens(
        np.asarray([token_id], np.int32),
        np.zeros(1, np.float32),
        np.ones(1, np.int32),
        np.zeros((1, 0), np.int32),
        np.zeros((1, 0), np.float32),
        np.zeros(1, np.int32),
    )
    taken = {request_id: [0] for request_id in outcome.num_taken}  # candidate 0: the one sampled row
    outputs, finished = processor.process(batch, sampled, taken, scheduler)  # it reads batch.sequences
    return outputs[0], finished


def test_a_stop_string_cuts_the_text_and_the_scheduler_records_it():
    scheduler, processor, request = _setup(SamplingParams(max_tokens=10, stop=["de"], temperature=0.0))
    output, finished = _step(scheduler, processor, 4)  # "d"
    assert output.outputs[0].text == "d" and not output.finished
    output, finished = _step(scheduler, processor, 5)  # "e": "de" ends it
    completion = output.outputs[0]
    assert completion.text == "" and completion.finish_reason == "stop" and completion.stop_reason == "de"
    assert output.finished and [group.request_id for group in finished] == ["r"]
    assert request.is_finished and not scheduler.has_unfinished_requests()  # the scheduler finished it


def test_a_stop_string_in_the_last_token_makes_the_finish_reason_stop():
    scheduler, processor, request = _setup(SamplingParams(max_tokens=2, stop=["ab"], temperature=0.0))
    _step(scheduler, processor, 1)
    output, _ = _step(scheduler, processor, 2)  # max_tokens reached and "ab" found with the same token
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == "ab"


def test_the_stop_token_is_not_part_of_the_text():
    scheduler, processor, request = _setup(SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[7]))
    _step(scheduler, processor, 3)
    output, _ = _step(scheduler, processor, 7)
    completion = output.outputs[0]
    assert completion.text == "c" and completion.token_ids == [3, 7]
    assert completion.finish_reason == "stop" and completion.stop_reason == 7
    scheduler, processor, request = _setup(SamplingParams(max_tokens=10, temperature=0.0))
    output, _ = _step(scheduler, processor, EOS)
    assert output.outputs[0].text == "" and output.outputs[0].stop_reason is None  # EOS: no stop reason


def test_seeds_come_from_the_params_or_one_draw_per_request():
    _, processor, request = _setup(SamplingParams(seed=41))
    assert processor.seed_of("r") == 41
    draws = [_setup(SamplingParams(), seed=5)[1].seed_of("r") for _ in range(2)]
    assert draws[0] == draws[1]  # the engine seed makes the draws reproducible


def test_abort_returns_the_unfinished_samples():
    _, processor, _ = _setup(SamplingParams(max_tokens=4))
    group, unfinished = processor.abort("r")
    assert group.request_id == "r" and unfinished == ["r"] and processor.abort("r") == (None, [])
