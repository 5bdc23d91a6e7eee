"""The `paxkv` command line: load a model and complete prompts greedily, streaming the text."""

import json
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF folder, .gguf file or orbax folder; default: the embedded SmolLM2.")
flags.DEFINE_multi_string("prompt", ["What is the capital of France?"], "Prompt(s) to complete; repeatable.")
flags.DEFINE_bool("chat", True, "Wrap each prompt as a user message in the model's chat template.")
flags.DEFINE_integer("max_tokens", 64, "Most tokens to generate per prompt.", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter storage dtype.")
flags.DEFINE_enum("attention_impl", "auto", ["auto", "pallas", "interpret", "xla"], "Attention implementation.")
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX persistent compilation cache folder "
    "(default $PAXKV_COMPILATION_CACHE_DIR or ~/.cache/paxkv/jax_compilation_cache).",
)
flags.DEFINE_string("metrics_json", None, "Write load time and token rates to this JSON file.")


def complete(loaded, prompt: str, *, chat: bool, max_tokens: int, out=sys.stdout) -> dict:
    """Stream one greedy completion to `out` and return its timings.

    Args:
      loaded: a models.LoadedModel with a tokenizer.
      prompt: the user's text.
      chat: wrap the prompt as a user message in the chat template.
      max_tokens: the most tokens to generate.
      out: where the text streams.
    """
    from models import greedy_tokens

    tokenizer = loaded.tokenizer
    if chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    else:
        prompt_ids = tokenizer.encode(prompt)
    detokenizer = tokenizer.detokenizer()
    start = time.perf_counter()
    first_token_at = second_token_at = None
    generated = []
    for token in greedy_tokens(
        loaded.graphdef,
        loaded.state,
        loaded.config,
        prompt_ids,
        max_tokens,
        stop_token_ids=loaded.generation_config.eos_token_ids,
    ):
        now = time.perf_counter()
        if first_token_at is None:
            first_token_at = now
        elif second_token_at is None:
            second_token_at = now  # the first decode step may include compilation; rate is timed after it
        generated.append(token)
        out.write(detokenizer.step(token))
        out.flush()
    out.write(detokenizer.flush() + "\n")
    end = time.perf_counter()
    steady_tokens = len(generated) - 2
    return {
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(generated),
        "time_to_first_token_s": first_token_at - start,
        "decode_tokens_per_s": steady_tokens / (end - second_token_at) if steady_tokens > 0 else None,
    }


def main(argv):
    del argv
    if not FLAGS["verbosity"].present:
        # Quiet by default: library INFO lines (e.g. JAX probing for a TPU) are noise; --verbosity=0 shows them.
        logging.set_verbosity(logging.WARNING)
    from models import CheckpointError, load
    from paxkv.compilation_cache import enable_compilation_cache

    cache_dir = enable_compilation_cache(FLAGS.compilation_cache_dir)
    logging.info("JAX compilation cache: %s", cache_dir)
    try:
        loaded = load(FLAGS.model, dtype=FLAGS.dtype, attention_impl=FLAGS.attention_impl)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"paxkv: {e}")
    print(
        f"# model {loaded.source} ({loaded.config.model_type}, {loaded.config.num_layers} layers), "
        f"loaded in {loaded.load_seconds:.1f} s",
        file=sys.stderr,
    )
    results = []
    for prompt in FLAGS.prompt:
        try:
            stats = complete(loaded, prompt, chat=FLAGS.chat, max_tokens=FLAGS.max_tokens)
        except ValueError as e:  # a bad prompt fails alone; the others still run
            print(f"paxkv: prompt {prompt[:40]!r} rejected: {e}", file=sys.stderr)
            results.append({"prompt": prompt, "error": str(e)})
            continue
        results.append({"prompt": prompt, **stats})
        rate = stats["decode_tokens_per_s"]
        print(
            f"# {stats['prompt_tokens']} prompt tokens, {stats['generated_tokens']} generated, "
            f"first token {stats['time_to_first_token_s']:.2f} s" + (f", decode {rate:.1f} tok/s" if rate else ""),
            file=sys.stderr,
        )
    if FLAGS.metrics_json:
        with open(FLAGS.metrics_json, "w") as f:
            json.dump({"load_seconds": loaded.load_seconds, "requests": results}, f, indent=2)
    if any("error" in r for r in results):
        sys.exit(1)


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
