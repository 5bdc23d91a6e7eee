"""Chained decode steps (EngineConfig.num_scheduler_steps, vLLM's multi-step scheduling): a step whose every
sequence decodes may run several decode passes on the device, each pass's sampled token the next pass's input, so
the host schedules, dispatches and reads back once per several tokens instead of once per token.

A chained sequence is planned the way a sequence with speculative drafts is: the KV slots of all its passes' input
tokens are allocated up front, and the tokens after its last known one are placeholders, which the step's own
samples fill (the model runner returns the batch with them filled in). So the page accounting and update() see a
step whose drafts were all accepted, and a stop token or stop string after pass j drops the later tokens the way
it drops accepted drafts after a stop. Each pass samples its position with that position's own key, so greedy and
seeded output are the tokens that one step per token gives.

Only steps that nothing else needs to see token by token chain: every sequence decodes one token without
penalties, logprobs or held-back stop tokens (min_tokens), nothing waits to be admitted (a chain would delay it),
and the step moves no pages. The engine asks for chains only where no running request streams its output.
"""

from paxkv.scheduling.request import Request
from paxkv.scheduling.scheduled_batch import ReplicaBatch
from paxkv.scheduling.stopping import holds_back_stops

# The token id a chained pass's input holds in the plan until the pass before it samples the real one.
PLACEHOLDER_TOKEN = 0


def samples_plainly(request: Request) -> bool:
    """Whether a request's next tokens are sampled from the logits alone: no penalties (which count earlier tokens),
    no logprobs, and no stop tokens held back for min_tokens."""
    params = request.sampling_params
    return not params.has_penalties and params.logprobs is None and not holds_back_stops(request)


def can_chain(batch: ReplicaBatch, num_waiting: int) -> bool:
    """Whether a replica's planned step may run chained decode passes (see the module's docstring).

    Args:
      batch: the step ReplicaScheduler.schedule() planned.
      num_waiting: the replica's requests waiting for admission.
    """
    if num_waiting or batch.preempted_request_ids or batch.forked:
        return False
    if batch.page_copies or batch.swap_out or batch.swap_in:
        return False
    return all(
        sequence.num_new_tokens == 1
        and sequence.completes_prompt
        and not sequence.num_draft_tokens
        and samples_plainly(sequence.request)
        for sequence in batch.sequences
    )


def most_passes(request: Request, max_steps: int, max_model_len: int) -> int:
    """The decode passes a decoding request may run in one chained step: at most max_steps, the tokens its
    max_tokens leaves, and the room left in the context (at least 1).

    Args:
      request: a running request about to decode.
      max_steps: the chain's length, num_scheduler_steps.
      max_model_len: the most tokens one request may reach.
    """
    remaining = request.sampling_params.max_tokens - request.num_output_tokens
    room = max_model_len - request.num_tokens  # pass j samples token number num_tokens + j
    return max(1, min(max_steps, remaining, room))
