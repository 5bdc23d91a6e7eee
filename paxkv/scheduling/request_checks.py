"""What makes a request malformed, checked before the engine accepts it: each failure names the problem and the fix.

check_fits_replica adds what only the scheduler knows: the context, the pool and the sequence budget.
"""

import numpy as np

from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams


def integer_token_ids(values) -> list[int]:
    """`values` as a list of Python ints, or a ValueError naming the first id that is not an integer.

    Python and numpy integers pass; floats, strings and booleans do not, even where int() would take them
    (1.9 would silently become 1).
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"token ids must be a list of integers, not {type(values).__name__}")
    token_ids = []
    for position, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"token id {position} is {value!r} ({type(value).__name__}); token ids must be integers")
        token_ids.append(int(value))
    return token_ids


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
        token_ids = integer_token_ids(prompt_token_ids)
    except ValueError as e:
        raise ValueError(f"request {request_id!r}: {e}") from None
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


def check_fits_replica(request: Request, page_size: int, max_model_len: int, num_pages: int, max_num_seqs: int) -> None:
    """Raises ValueError, naming the fix, unless the request can run alone in a replica with these limits.

    Args:
      request: the request to admit.
      page_size: tokens per page.
      max_model_len: the most tokens (prompt plus output) one request may reach.
      num_pages: the pages in the replica's pool.
      max_num_seqs: the most sequences running at once.
    """
    num_prompt_tokens = request.num_prompt_tokens
    if num_prompt_tokens == 0:
        raise ValueError(f"request {request.request_id!r} has an empty prompt; give at least one prompt token")
    max_tokens = request.sampling_params.max_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"request {request.request_id!r} has {num_prompt_tokens} prompt tokens + max_tokens {max_tokens} = "
            f"{num_prompt_tokens + max_tokens} tokens but max_model_len is {max_model_len}; "
            "shorten the prompt, lower max_tokens or raise max_model_len"
        )
    num_pages_needed = Request.num_pages_needed(page_size, num_prompt_tokens + max_tokens)
    if num_pages_needed > num_pages:
        raise ValueError(
            f"request {request.request_id!r} needs up to {num_pages_needed} pages of {page_size} tokens "
            f"({num_prompt_tokens} prompt tokens + max_tokens {max_tokens}) but the pool has only "
            f"{num_pages}; raise num_pages, or shorten the prompt or lower max_tokens"
        )
    num_samples = request.sampling_params.n
    if num_samples > max_num_seqs:
        raise ValueError(
            f"request {request.request_id!r} asks for n={num_samples} samples but at most max_num_seqs="
            f"{max_num_seqs} sequences run at once; lower n or raise max_num_seqs"
        )


def check_positive_integers(**values) -> None:
    """Raise ValueError naming the first of `values` that is not a positive integer (bools are not integers here)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
