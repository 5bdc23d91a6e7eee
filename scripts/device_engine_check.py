"""The engine end to end on an accelerator: the Pallas kernel's greedy tokens against the XLA path's, and tokens/s.

    python scripts/device_engine_check.py [--out DIR] [--parts greedy,throughput] [--throughput_kv bfloat16,int8]

Random Llamas saved by `transformers` (torch builds them on the host, so nothing is downloaded):
- correctness: a tiny Llama (the engine tests' shape), 8 requests of 1-70 tokens arriving two per step
  (chunked prefill mixed with decodes), greedy, through `Engine` on `attention_impl="pallas"` and on `"xla"`,
  each KV dtype in turn; f32 KV under f32 activations and "highest" matmul precision must give identical tokens;
  the others (bf16 activations) are reported as the fraction of tokens that agree (a tie broken the other way
  changes the rest of its row);
- throughput: a random Llama of SmolLM2-135M's shape in bf16, 64 prompts of 256 tokens, 128 new tokens each,
  on both implementations; of two runs of the same shapes, the second is timed (the first compiles; each run
  draws fresh prompts, so none hits the prefix cache). Not yet run on a device since that change.

Needs jax (with its GPU or TPU plugin), flax, numpy, torch and transformers: what a CUDA image holds.
Writes DIR/engine_check_<parts>.json and prints a table last; exits nonzero when an f32 comparison differs.
"""

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from paxkv import LLM, SamplingParams  # noqa: E402
from paxkv.config import EngineConfig  # noqa: E402
from paxkv.core.engine import Engine  # noqa: E402

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    intermediate_size=1536,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
IMPLS = ("pallas", "xla")  # "pallas" is interpreted on a CPU (a smoke run of this script)


def save_random_llama(directory: str, torch_dtype: str, **config) -> str:
    """A random transformers LlamaForCausalLM saved as safetensors under directory."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(getattr(torch, torch_dtype))
    model.save_pretrained(directory)
    return directory


def _on_this_backend(attention_impl: str) -> str:
    """The Pallas kernel natively on an accelerator, interpreted on a CPU."""
    return "interpret" if attention_impl == "pallas" and jax.default_backend() == "cpu" else attention_impl


def greedy_tokens(path: str, attention_impl: str, kv_cache_dtype: str) -> dict[str, list[int]]:
    """8 requests of 1 to 70 tokens, arriving two per step, 10 greedy tokens each."""
    # f32 KV is compared under f32 activations too (an accelerator's default is bf16): the one exact comparison.
    compute_dtype = "float32" if kv_cache_dtype == "float32" else None
    loaded = models.load(
        path, require_tokenizer=False, attention_impl=_on_this_backend(attention_impl), compute_dtype=compute_dtype
    )
    config = EngineConfig(
        num_pages=80, page_size=8, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype
    )
    engine = Engine(loaded, config)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 70, 9, 16, 17, 33, 5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results, pending = {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                index, prompt = pending.pop(0)
                engine.add_request(str(index), prompt, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return results


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Fraction of positions where two runs' tokens agree."""
    pairs = [(x, y) for key in a for x, y in zip(a[key], b[key], strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def throughput(path: str, attention_impl: str, kv_cache_dtype: str) -> dict:
    """Output tokens/s of 64 prompts x 256 tokens, 128 new tokens each (second run of two)."""
    llm = LLM(
        path,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        attention_impl=_on_this_backend(attention_impl),
        kv_cache_dtype=kv_cache_dtype,
        num_pages=64 * 384 // 16 + 64,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    seconds = []
    for _ in range(2):
        # Fresh prompts of the same lengths: the same step shapes, but no prefix-cache hits (a second run of the
        # same prompts would prefill one token each, in shapes the first never compiled).
        prompts = [rng.integers(0, 49152, 256).tolist() for _ in range(64)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    return dict(
        impl=attention_impl,
        kv=kv_cache_dtype,
        first_run_s=seconds[0],
        timed_s=seconds[1],
        output_tokens=tokens,
        tokens_per_s=tokens / seconds[1],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_results"))
    parser.add_argument("--parts", default="greedy,throughput", help="which checks to run, comma-separated")
    parser.add_argument("--throughput_kv", default="bfloat16,int8", help="KV dtypes of the throughput runs")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    report, failed = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, greedy=[], throughput=[]), False
    with tempfile.TemporaryDirectory() as scratch:
        tiny = save_random_llama(os.path.join(scratch, "tiny"), "float32", **TINY)
        for kv in ("float32", "bfloat16", "int8", "fp8_e4m3") if "greedy" in args.parts else ():
            with jax.default_matmul_precision("highest" if kv == "float32" else "default"):
                runs = {impl: greedy_tokens(tiny, impl, kv) for impl in IMPLS}
            agree = agreement(runs["pallas"], runs["xla"])
            failed |= kv == "float32" and agree < 1.0
            report["greedy"].append(dict(kv=kv, agreement=agree))
            print(f"greedy kv={kv}: pallas vs xla agree on {agree:.1%} of tokens", flush=True)
        if "throughput" in args.parts:
            smol = save_random_llama(os.path.join(scratch, "smol"), "bfloat16", **SMOLLM2_SHAPE)
            for kv in args.throughput_kv.split(","):
                for impl in IMPLS:
                    row = throughput(smol, impl, kv)
                    report["throughput"].append(row)
                    print(f"throughput {row}", flush=True)
    with open(os.path.join(args.out, f"engine_check_{args.parts.replace(',', '_')}.json"), "w") as file:
        json.dump(report, file, indent=2)
    print("| KV | pallas vs xla greedy agreement |\n|---|---|")
    for row in report["greedy"]:
        print(f"| {row['kv']} | {row['agreement']:.1%} |")
    print("| impl | KV | tokens/s (timed run) | first run s |\n|---|---|---|---|")
    for row in report["throughput"]:
        print(f"| {row['impl']} | {row['kv']} | {row['tokens_per_s']:.0f} | {row['first_run_s']:.1f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
