"""LLM: the Python batch API over the engine (load once, generate for many prompts)."""

import functools
import itertools

from paxkv.config import EngineConfig, LoadConfig
from paxkv.core.outputs import RequestOutput
from paxkv.entrypoints.batch_runner import admit_all, drain, encode_chat, encode_prompt
from paxkv.entrypoints.engine_loading import load_engine
from paxkv.scheduling.sampling_params import SamplingParams


class LLM:
    """Batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self,
        model=None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        skip_tokenizer_init: bool = False,
        attention_impl: str = "auto",
        allow_nonfinite_weights: bool = False,
        **engine_config,
    ):
        """Load a model and start an engine over it.

        Args:
          model: anything models.load accepts; None is the embedded SmolLM2.
          dtype: parameter storage dtype.
          quantization: None, or "int8" for weight-only int8 projections (an f32 scale and min per group of 32
            weights; the native CPU matmul on one device; LoadConfig.quantization).
          skip_tokenizer_init: load weights only (as vLLM's flag); prompts must then be token-id lists.
          attention_impl: auto | pallas | interpret | cpu_native | xla.
          allow_nonfinite_weights: load weights holding NaN or Inf instead of refusing them.
          **engine_config: EngineConfig fields (num_pages, max_num_seqs, max_num_batched_tokens, mesh_shape, ...,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4} as vLLM names it).
        """
        load_config = LoadConfig(
            dtype=dtype,
            quantization=quantization or "none",
            attention_impl=attention_impl,
            skip_tokenizer_init=skip_tokenizer_init,
            allow_nonfinite_weights=allow_nonfinite_weights,
        )
        self.engine = load_engine(model, EngineConfig(**engine_config), load_config)
        self.loaded = self.engine.loaded
        self._request_ids = itertools.count()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        Every prompt is checked before any runs, so a bad one fails the call without side effects, with an
        error naming its position in `prompts`.

        Args:
          prompts: a str, or a list of str, token-id lists, or dicts as vLLM's prompt dicts:
            {"prompt": str} or {"prompt_token_ids": [...]}, with an optional "cache_salt" (requests with
            different salts never share cached KV pages).
          sampling_params: one SamplingParams for all prompts, or one per prompt; default SamplingParams().
          use_tqdm: show a progress bar on stderr.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                "prompts must be a string or a list of prompts (strings, token-id lists or prompt dicts), "
                f"not {type(prompts).__name__}"
            )
        prompts = list(prompts)
        sampling_params = self._broadcast(sampling_params, len(prompts))
        requests = [self._tokenize(index, prompt) for index, prompt in enumerate(prompts)]
        return self._run(requests, sampling_params, use_tqdm)

    def chat(self, messages_or_conversations, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        Args:
          messages_or_conversations: a list of {"role", "content"} dicts, or a list of such lists.
          sampling_params: as in generate.
          use_tqdm: show a progress bar on stderr.
        """
        conversations = messages_or_conversations
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError(
                "chat takes a conversation (a list of {'role', 'content'} dicts) or a list of conversations, "
                f"not {conversations!r:.80}"
            )
        if isinstance(conversations[0], dict):
            conversations = [conversations]
        sampling_params = self._broadcast(sampling_params, len(conversations))
        requests = []
        for index, messages in enumerate(conversations):
            try:
                requests.append((*encode_chat(self.loaded.tokenizer, messages), None))
            except ValueError as e:
                raise ValueError(f"conversation {index}: {e}") from None
        return self._run(requests, sampling_params, use_tqdm, noun="conversation")

    @staticmethod
    def _broadcast(sampling_params, num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, or a TypeError/ValueError naming what was expected."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * num_prompts
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(params, SamplingParams) for params in sampling_params
        ):
            hint = (
                f"; build one with SamplingParams(**{sampling_params!r:.60})"
                if isinstance(sampling_params, dict)
                else ""
            )
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (one per prompt), not "
                f"{type(sampling_params).__name__}{hint}"
            )
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts; pass one, or one per prompt"
            )
        return list(sampling_params)

    def _tokenize(self, index: int, prompt) -> tuple[str | None, list[int], str | None]:
        """(prompt text or None, token ids, cache salt) for a string, a token-id list or a prompt dict."""
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
            given = [key for key in ("prompt", "prompt_token_ids") if key in prompt]
            if unknown or len(given) != 1:
                raise ValueError(
                    f"prompt {index} is a dict with keys {sorted(prompt)}; give exactly one of 'prompt' or "
                    "'prompt_token_ids', and optionally 'cache_salt'"
                )
            cache_salt = prompt.get("cache_salt")
            prompt = prompt[given[0]]
        if not isinstance(prompt, (str, list, tuple)) and not hasattr(prompt, "__array__"):
            raise TypeError(
                f"prompt {index} is a {type(prompt).__name__}; give a string, a list of token ids or a prompt dict"
            )
        try:
            token_ids = encode_prompt(self.loaded.tokenizer, prompt)
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None
        return (prompt if isinstance(prompt, str) else None), token_ids, cache_salt

    def _run(self, requests, sampling_params, use_tqdm: bool, noun: str = "prompt") -> list[RequestOutput]:
        """Add every request (all or none), step until all finish, return outputs in order.

        An interrupt (KeyboardInterrupt) aborts the call's requests before it propagates, so the LLM stays usable.
        """
        ids = [f"llm-{next(self._request_ids)}" for _ in requests]
        adds = [
            (
                request_id,
                functools.partial(
                    dict,
                    prompt_token_ids=token_ids,
                    sampling_params=params,
                    prompt=text,
                    cache_salt=salt,
                    final_only=True,  # drain keeps only finished outputs
                ),
            )
            for request_id, (text, token_ids, salt), params in zip(ids, requests, sampling_params, strict=True)
        ]
        errors = admit_all(self.engine, adds, keep_admitted=False)
        for index, (request_id, error) in enumerate(zip(ids, errors, strict=True)):
            if error is not None:  # a bad prompt fails the call before anything ran, named by its position
                raise ValueError(error.replace(f"request {request_id!r}", f"{noun} {index}"))
        try:
            finished = drain(self.engine, len(ids), progress=use_tqdm)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [finished[request_id] for request_id in ids]
