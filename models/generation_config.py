"""GenerationConfig: token ids and sampling defaults that ship with a checkpoint."""

import dataclasses
import json
import os
from typing import Any

from models.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What a checkpoint says about generation: which tokens end it, and default sampling."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GenerationConfig":
        """Accept both our own form and HF's generation_config.json (eos_token_id may be a list)."""
        eos = values.get("eos_token_ids", values.get("eos_token_id"))
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        else:
            eos_ids = tuple(int(e) for e in eos)
        return cls(
            bos_token_id=values.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=values.get("pad_token_id"),
            temperature=values.get("temperature"),
            top_k=values.get("top_k"),
            top_p=values.get("top_p"),
        )

    @classmethod
    def from_hf_dir(cls, path: str, hf_config: dict[str, Any]) -> "GenerationConfig":
        """Read generation_config.json, falling back to the token ids in config.json."""
        file = os.path.join(path, "generation_config.json")
        values = dict(hf_config)
        if os.path.exists(file):
            try:
                with open(file) as f:
                    values.update(json.load(f))
            except json.JSONDecodeError as e:
                raise CheckpointError(
                    f"{file} is not valid JSON ({e}); fix it, re-download it, or delete it to use config.json's ids"
                ) from None
        return cls.from_dict(values)
