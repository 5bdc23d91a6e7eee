"""Per-request sampling settings, with vLLM's field names and defaults, validated on construction."""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

# A temperature below this is greedy decoding, as in vLLM: dividing logits by a tinier one overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
# presence_penalty and frequency_penalty must lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (the OpenAI API range).
PENALTY_LIMIT = 2.0
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs; keeps the top-k width (a compiled shape) small


def _as_int(name: str, value: Any) -> int:
    """`value` as an int, or a ValueError naming the field; bools are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def _as_float(name: str, value: Any) -> float:
    """`value` as a finite float, or a ValueError naming the field; bools are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request: vLLM's fields and defaults; frozen, so use dataclasses.replace to change one.

    top_k: 0 and -1 both mean "no top-k" (vLLM accepts both); -1 is stored as 0, the one disabled value.
    temperature: 0 (or anything below GREEDY_TEMPERATURE_EPS, as in vLLM) is greedy decoding.
    seed: None lets the engine choose a seed; with a seed, the samples depend only on (seed, position).
    stop: stored as a tuple of non-empty strings; stop_token_ids as a tuple of non-negative ints.
    logprobs: None for none, else how many top log-probabilities (at most MAX_LOGPROBS) to return per generated
      token; the sampled token's own log-probability is always included.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        """Validate every field and normalize top_k, stop and stop_token_ids."""
        set_field = lambda name, value: object.__setattr__(self, name, value)

        n = _as_int("n", self.n)
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")

        temperature = _as_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        set_field("temperature", temperature)

        top_p = _as_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
        set_field("top_p", top_p)

        top_k = _as_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {top_k}")
        set_field("top_k", 0 if top_k == -1 else top_k)

        min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")
        set_field("min_p", min_p)

        if self.seed is not None:
            _as_int("seed", self.seed)

        max_tokens = _as_int("max_tokens", self.max_tokens)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        min_tokens = _as_int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if min_tokens > max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")

        set_field("stop", self._normalize_stop(self.stop))
        set_field("stop_token_ids", self._normalize_stop_token_ids(self.stop_token_ids))

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if self.logprobs is not None:
            logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be None or in [0, {MAX_LOGPROBS}] (the number of top log-probs), got {logprobs}"
                )
            set_field("logprobs", logprobs)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}] (0 disables it), got {value}")
            set_field(name, value)

        repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {repetition_penalty}")
        set_field("repetition_penalty", repetition_penalty)

    @staticmethod
    def _normalize_stop(stop: Any) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings: None gives (), one string gives a 1-tuple."""
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, Sequence):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for entry in stop:
            if not isinstance(entry, str):
                raise ValueError(f"stop must hold only strings, got {entry!r} ({type(entry).__name__})")
            if not entry:
                raise ValueError("stop strings must be non-empty; an empty string would stop at once")
        return tuple(stop)

    @staticmethod
    def _normalize_stop_token_ids(stop_token_ids: Any) -> tuple[int, ...]:
        """`stop_token_ids` as a tuple of non-negative ints: None gives ()."""
        if stop_token_ids is None:
            return ()
        if isinstance(stop_token_ids, str | bytes) or not isinstance(stop_token_ids, Sequence):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        for token_id in stop_token_ids:
            _as_int("stop_token_ids entry", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {token_id}")
        return tuple(stop_token_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (sampling then depends on earlier tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0, or below GREEDY_TEMPERATURE_EPS)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of all fields, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Build from a mapping (e.g. one JSONL line's sampling fields), refusing unknown fields.

        Args:
          d: field name to value; missing fields take their defaults.
        Returns:
          The validated SamplingParams.
        Raises:
          ValueError: on an unknown field (the message lists the valid ones) or an invalid value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be a mapping of field to value, got {type(d).__name__}")
        valid = cls.field_names()
        unknown = sorted(str(key) for key in d if key not in valid)
        if unknown:
            raise ValueError(f"unknown sampling field(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
        return cls(**d)
