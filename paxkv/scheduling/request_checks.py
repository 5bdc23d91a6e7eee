"""What makes a request malformed, checked before the engine accepts it: each failure names the problem and the fix.

The scheduler adds what only it knows (the context and the pool: paxkv.scheduling.replica_scheduler.add_request).
"""

from paxkv.scheduling.sampling_params import SamplingParams


def check_request(
    request_id: str, prompt_token_ids, sampling_params, cache_salt, priority, vocab_size: int
) -> list[int]:
    """The prompt's token ids as ints, or a ValueError naming what is wrong with the request and how to fix it.

    Args:
      request_id: the caller's id (named in the errors).
      prompt_token_ids: the prompt's token ids.
      sampling_params: how to sample.
      cache_salt: None or a string.
      priority: an int.
      vocab_size: the model's vocabulary size.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"request {request_id!r}: priority must be an int, not {priority!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"request {request_id!r}: cache_salt must be a string or None, not {cache_salt!r}")
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"request {request_id!r}: sampling_params must be a SamplingParams, not {sampling_params!r}")
    try:
        token_ids = [int(t) for t in prompt_token_ids]
    except (TypeError, ValueError):
        raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of ints") from None
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {request_id!r} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
            "tokenize with this model's tokenizer"
        )
    bad_stops = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ValueError(
            f"request {request_id!r} has stop_token_ids outside the vocabulary [0, {vocab_size}): {bad_stops[:5]}"
        )
    return token_ids
