"""When a request stops: the rules, in one place.

A request stops after an end-of-sequence or stop token (once it has min_tokens outputs), at max_tokens or
max_model_len, or when its text contains a stop string. The scheduler alone records the decision (a
request's finish_reason and stop_reason); the step holds stop tokens back while min_tokens is not reached,
and the output processor finds stop strings in the text it detokenizes. All of them ask these functions.
"""

from collections.abc import Collection, Iterable

from paxkv.scheduling.request import Request

# The token the step reports for a row whose logits hold NaN or Inf (no real token id is negative), and why such
# a request finishes with finish_reason "error" instead of a token sampled from garbage.
NONFINITE_TOKEN = -1
NONFINITE_REASON = (
    "the model's logits were NaN or Inf at this position, so no token could be sampled; check the checkpoint "
    "and the dtype (bfloat16 overflows where float32 does not)"
)


def holds_back_stops(request: Request) -> bool:
    """Whether the request's next token may not be a stop token: it has fewer than min_tokens outputs."""
    return request.num_output_tokens < request.sampling_params.min_tokens


def stop_token_ids(request: Request, eos_token_ids: Iterable[int]) -> list[int]:
    """The tokens that end the request: its stop_token_ids, and EOS unless it ignores it."""
    params = request.sampling_params
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def stop_after_token(
    request: Request, token_id: int, eos_token_ids: Collection[int], max_model_len: int
) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) once `token_id` has been appended to `request`; (None, None) if it goes on.

    The stop reason is the stop token when one of the request's stop_token_ids ended it (None for EOS and length),
    as vLLM reports it. NONFINITE_TOKEN (not appended) finishes the request with "error" and NONFINITE_REASON.

    Args:
      request: the request, its new token already appended.
      token_id: that token.
      eos_token_ids: the model's end-of-sequence tokens.
      max_model_len: the most tokens a request may reach.
    """
    params = request.sampling_params
    if token_id == NONFINITE_TOKEN:  # not appended: nothing could be sampled
        return "error", NONFINITE_REASON
    # The step holds stop tokens back while fewer than min_tokens outputs preceded this one (holds_back_stops);
    # this makes min_tokens hold regardless.
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return "length", None
    return None, None


def append_tokens(
    request: Request, tokens: list[int], eos_token_ids: Collection[int], max_model_len: int
) -> tuple[int, str | None]:
    """Append a step's tokens to a request one by one until one stops it; return how many it took and the finish
    reason (None if it goes on). The request's stop_reason is set as stop_after_token says.

    Args:
      request: the request.
      tokens: its sampled token, or its accepted drafts and the token after them (NONFINITE_TOKEN is not appended).
      eos_token_ids: the model's end-of-sequence tokens.
      max_model_len: the most tokens a request may reach.
    """
    for taken, token_id in enumerate(tokens, start=1):
        if token_id != NONFINITE_TOKEN:  # else the request finishes with "error", and no token
            request.output_token_ids.append(token_id)
        finish_reason, request.stop_reason = stop_after_token(request, token_id, eos_token_ids, max_model_len)
        if finish_reason is not None:
            return taken, finish_reason
    return len(tokens), None


def ended_by_stop_token(request: Request, token_id: int, eos_token_ids: Collection[int]) -> bool:
    """Whether `token_id`, the request's last, is what stopped it (so it is left out of the text)."""
    params = request.sampling_params
    return request.finish_reason == "stop" and (token_id in params.stop_token_ids or token_id in eos_token_ids)


def find_stop_string(text: str, stops: Iterable[str]) -> tuple[int, str] | None:
    """(index, stop) of the first of `stops` found in `text`, in the order given; None if none is there."""
    for stop in stops:
        index = text.find(stop)
        if index >= 0:
            return index, stop
    return None
