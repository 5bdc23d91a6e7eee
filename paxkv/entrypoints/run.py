"""The `paxkv` command line: run prompts (flags or a JSONL file) through the paged engine, or serve the OpenAI API.

paxkv --chat --prompt "What is the capital of France?" --max_tokens 24 --temperature 0
paxkv --prompts_file prompts.jsonl --output results.jsonl --max_num_seqs 64
paxkv serve --port 8000
"""

import io
import json
import os
import sys

from absl import app, flags, logging

from paxkv.config import EngineConfig, LoadConfig
from paxkv.entrypoints import serve as serve_command  # its flags
from paxkv.entrypoints.config_flags import config_from_flags, define_flags, parse_memory_size
from paxkv.entrypoints.run_summary import print_summary, run_summary

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF folder, .gguf file or orbax folder; default: the embedded SmolLM2.")
flags.DEFINE_multi_string("prompt", None, "A prompt to complete; repeatable.")
flags.DEFINE_string(
    "prompts_file",
    None,
    'JSONL, one object per line: "prompt" (text or token ids) or "messages" (chat), optional "id", and any '
    "SamplingParams fields, which override the flags.",
)
flags.DEFINE_bool("chat", False, "Treat each --prompt as a user message and apply the model's chat template.")
flags.DEFINE_string("output", None, "Write one JSON object per request (in input order) to this JSONL file.")
flags.DEFINE_bool("skip_bad_lines", False, "Report bad --prompts_file lines and run the rest, instead of stopping.")
flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
# Sampling defaults; None leaves SamplingParams' own default.
flags.DEFINE_integer(
    "max_tokens",
    64,
    "Most tokens to generate per prompt (SamplingParams defaults to vLLM's 16, short for an answer on a terminal).",
)
flags.DEFINE_float("temperature", None, "Sampling temperature; 0 is greedy (default 1.0).")
flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1] (default 1: off).")
flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens; 0 or -1 is off (default).")
flags.DEFINE_float("min_p", None, "Drop tokens below min_p times the top probability (default 0: off).")
flags.DEFINE_integer("seed", None, "Sampling seed for every request (default: the engine draws one per request).")
# Engine and model loading: one flag per field of EngineConfig and LoadConfig, with its default and help.
define_flags(EngineConfig)
define_flags(LoadConfig)
flags.DEFINE_string("coordinator_address", None, "Multi-process: process 0's HOST:PORT, the same on every process.")
flags.DEFINE_integer("num_processes", None, "Multi-process: how many processes take part.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index in [0, num_processes).")
flags.DEFINE_integer("distributed_timeout", 300, "Multi-process: seconds to wait for every process to join.")
flags.DEFINE_bool("distributed_auto", False, "Multi-process: let JAX find the cluster (TPU pod slices, SLURM).")
flags.DEFINE_bool("plan", False, "Print the KV memory plan for --model (a config.json is enough) and exit.")
flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "JAX persistent compilation cache folder "
    "(default $PAXKV_COMPILATION_CACHE_DIR or ~/.cache/paxkv/jax_compilation_cache).",
)
flags.DEFINE_string("metrics_json", None, "Write the engine's metrics and the run summary to this JSON file.")
flags.DEFINE_bool(
    "resume",
    False,
    "Complete an earlier run into the same --output: keep every line its output or journal finished (the line "
    "unchanged) and run the rest.",
)


def _usage_error(message: str):
    """Exit with one line naming what is wrong with the command (absl's UsageError would print every flag)."""
    sys.exit(f"paxkv: {message} (paxkv --help lists the flags)")


def _sampling_defaults() -> dict:
    """The sampling fields the flags set."""
    defaults = {"max_tokens": FLAGS.max_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if getattr(FLAGS, name) is not None:
            defaults[name] = getattr(FLAGS, name)
    return defaults


def _collect_lines(defaults: dict):
    """Every request to run, as PromptLine or BadLine, from --prompt then --prompts_file."""
    from paxkv.entrypoints.prompts_file import BadLine, PromptLine, parse_lines
    from paxkv.parallel.distributed import broadcast_json, is_leader
    from paxkv.scheduling.sampling_params import SamplingParams

    try:
        params = SamplingParams.from_dict(defaults)  # the flags alone must make valid params
    except ValueError as e:
        _usage_error(str(e))
    lines: list = []
    for index, prompt in enumerate(FLAGS.prompt or []):
        messages = [{"role": "user", "content": prompt}] if FLAGS.chat else None
        lines.append(PromptLine(None, f"prompt-{index}", None if FLAGS.chat else prompt, messages, params))
    if FLAGS.prompts_file:
        # Process 0 reads the file and every process gets its text, so all run the same requests.
        text, error = broadcast_json(_read_prompts_file() if is_leader() else None)
        if error:
            _usage_error(error)
        lines += parse_lines(io.StringIO(text), defaults, FLAGS.prompts_file)
    if not lines:
        _usage_error("nothing to run: give --prompt (repeatable) or --prompts_file")
    bad = [line for line in lines if isinstance(line, BadLine)]
    if bad and not FLAGS.skip_bad_lines:
        errors = "\n".join(line.error for line in bad)
        sys.exit(f"paxkv: {len(bad)} bad line(s); fix them or pass --skip_bad_lines to run the rest:\n{errors}")
    return lines


def _read_prompts_file() -> tuple[str | None, str | None]:
    """(the --prompts_file text, None), or (None, why it cannot be read or holds nothing)."""
    from paxkv.entrypoints.prompts_file import decode_file

    try:
        with open(FLAGS.prompts_file, "rb") as f:
            text = decode_file(f.read())
    except OSError as e:
        return None, f"cannot read --prompts_file: {e}"
    if not text.strip():
        return None, f"--prompts_file {FLAGS.prompts_file} is empty; give one JSON object per line"
    return text, None


def _print_plan() -> None:
    """`--plan`: KV capacity for --model from its config alone, for every KV dtype."""
    import models.loading
    from models.errors import CheckpointError
    from paxkv.entrypoints.planner import format_plan, plan, plan_model_config

    try:
        config = plan_model_config(FLAGS.model)
        budget = parse_memory_size(FLAGS.kv_cache_memory)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"paxkv: {e}")
    max_model_len = FLAGS.max_model_len or config.max_position_embeddings
    rows, num_params = plan(
        config, kv_cache_memory_bytes=budget, max_model_len=max_model_len, page_size=FLAGS.page_size
    )
    chosen = FLAGS.kv_cache_dtype if FLAGS.kv_cache_dtype != "auto" else models.loading.default_compute_dtype()
    print(
        format_plan(
            config,
            rows,
            num_params,
            max_model_len=max_model_len,
            page_size=FLAGS.page_size,
            kv_cache_memory_bytes=budget,
            chosen=chosen,
        )
    )


def main(argv):
    if not FLAGS["verbosity"].present:
        # Quiet by default: library INFO lines (e.g. JAX probing for a TPU) are noise; --verbosity=0 shows them.
        logging.set_verbosity(logging.WARNING)
    if argv[1:] == ["serve"]:
        serve_command.serve(_usage_error)
        return
    if len(argv) > 1:
        _usage_error(
            f"unexpected arguments {argv[1:]}; prompts go in --prompt or --prompts_file, and `paxkv serve` serves"
        )
    if FLAGS.plan:
        _print_plan()
        return
    from paxkv.entrypoints.interrupts import GracefulStop

    with GracefulStop() as stop:
        _run(stop)


def _output_paths_problem() -> str | None:
    """Why --output or --metrics_json cannot be written (or would drop an earlier run's journal), or None."""
    from paxkv.entrypoints.output_files import check_writable, journal_path

    for flag, path in (("--output", FLAGS.output), ("--metrics_json", FLAGS.metrics_json)):
        if path:
            try:
                check_writable(path, flag)
            except ValueError as e:
                return str(e)
    journal = journal_path(FLAGS.output) if FLAGS.output else None
    if journal and os.path.exists(journal) and not FLAGS.resume:
        return (
            f"{journal} holds the results an earlier run of this output finished; rerun with --resume to keep them "
            "and run the rest, or delete it to start over"
        )
    return None


def _resume_split(lines: list, leader: bool) -> tuple[list, dict[int, dict]]:
    """(lines to run, {index: earlier record} of lines done), decided by process 0 and shared with the others."""
    from paxkv.entrypoints.resume import finished_records, split_done
    from paxkv.parallel.distributed import broadcast_json

    def decide():
        try:
            _, done = split_done(lines, finished_records(FLAGS.output))
        except ValueError as e:
            return {"error": str(e)}
        return {"done": {str(index): record for index, record in done.items()}}

    decision = broadcast_json(decide() if leader else None)
    if "error" in decision:
        sys.exit(f"paxkv: {decision['error']}")
    done = {int(index): record for index, record in decision["done"].items()}
    return [line for index, line in enumerate(lines) if index not in done], done


def _run(stop) -> None:
    """Everything after flag parsing, under the run's signal handlers."""
    from paxkv.parallel.distributed import broadcast_json, initialize, is_leader

    try:
        initialize(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            timeout_seconds=FLAGS.distributed_timeout,
            auto_detect=FLAGS.distributed_auto,
        )
    except ValueError as e:
        _usage_error(str(e))
    except RuntimeError as e:
        sys.exit(f"paxkv: {e}")
    stop.reinstall()  # jax.distributed installs its own SIGTERM handler, which would swallow the signal
    leader = is_leader()  # only process 0 writes outputs and metrics; every process computes
    if FLAGS.resume and not FLAGS.output:
        _usage_error("--resume needs --output: it completes the output (and journal) of an earlier run")
    # Process 0 checks the paths it will write, and every process hears the verdict (so none waits alone).
    problem = broadcast_json(_output_paths_problem() if leader else None)
    if problem:
        sys.exit(f"paxkv: {problem}")
    all_lines = _collect_lines(_sampling_defaults())
    lines, done = _resume_split(all_lines, leader) if FLAGS.resume else (all_lines, {})
    try:
        engine_config = config_from_flags(EngineConfig)
        load_config = config_from_flags(LoadConfig)
    except ValueError as e:
        _usage_error(str(e))

    from paxkv.entrypoints.batch_runner import BadRequestsError, run_lines
    from paxkv.entrypoints.compile_time import compile_totals
    from paxkv.entrypoints.engine_loading import start_command_line_engine
    from paxkv.entrypoints.output_files import Journal, journal_path, jsonl, write_atomically
    from paxkv.entrypoints.resume import merge
    from paxkv.parallel.distributed import any_process

    engine = start_command_line_engine(FLAGS.model, engine_config, load_config, FLAGS.compilation_cache_dir)
    loaded = engine.loaded
    num_pages, page_size = engine.scheduler.num_total_pages, engine_config.page_size
    if leader:
        print(
            f"# model {loaded.source} ({loaded.config.model_type}, {loaded.config.num_layers} layers), loaded in "
            f"{loaded.load_seconds:.1f} s\n# KV pool: {num_pages} pages of {page_size} tokens = "
            f"{num_pages * page_size} tokens of {engine.pool.dtype.name}, {engine.pool.bytes_per_token} bytes per "
            f"token{' (8-bit scales included)' if engine.pool.dtype.itemsize == 1 else ''}, "
            f"{engine.pool.total_bytes / 2**20:.0f} MiB",
            file=sys.stderr,
        )
        if done:
            print(
                f"# --resume: {len(done)} of {len(all_lines)} lines already finished; running {len(lines)}",
                file=sys.stderr,
            )
    journal = Journal(journal_path(FLAGS.output), keep_existing=FLAGS.resume) if FLAGS.output and leader else None
    stream = FLAGS.output is None and len(lines) == 1 and leader

    def stop_reason() -> str:
        if stop.requested:
            return f"interrupted by {stop.name} before it finished; rerun with --resume to finish it"
        return "another process of this run was interrupted before it finished; rerun with --resume"

    stop.arm()
    compiled_before = compile_totals()
    try:
        records, wall_seconds = run_lines(
            engine,
            lines,
            skip_bad_lines=FLAGS.skip_bad_lines,
            stream_to=sys.stdout if stream else None,
            progress=FLAGS.progress and not stream and leader,
            on_record=journal.append if journal else None,
            should_stop=lambda: any_process(stop.requested),  # every process stops at the same step
            stop_reason=stop_reason,
        )
    except BadRequestsError as e:
        if journal:
            journal.remove()  # nothing ran
        sys.exit(f"paxkv: {len(e.errors)} request(s) cannot run; fix them or pass --skip_bad_lines:\n{e}")
    compiling = compile_totals() - compiled_before
    records = merge(all_lines, lines, records, done)
    aborted = [record for record in records if record.get("finish_reason") == "abort"]
    if not leader:
        if aborted:
            sys.exit(stop.exit_code if stop.requested else 1)
        return
    num_failed = sum("error" in record for record in records)
    if FLAGS.output:
        write_atomically(FLAGS.output, jsonl(records))
        if not aborted:
            journal.remove()  # the output holds everything now
        else:
            journal.close()
    elif not stream:
        for record in records:
            print(f"--- {record['id']}")
            print(record.get("text", f"[error] {record.get('error')}"))
    for record in records:
        if "error" in record:
            print(f"paxkv: {record['error']}", file=sys.stderr)
    summary = run_summary(engine, wall_seconds, num_failed, compiling)
    summary.update(resumed_requests=len(done), aborted_requests=len(aborted))
    print_summary(summary)
    if FLAGS.metrics_json:
        report = {"load_seconds": loaded.load_seconds, "summary": summary, "engine": engine.metrics.as_dict()}
        write_atomically(FLAGS.metrics_json, json.dumps(report, indent=2))
    if aborted:
        started = sum(record.get("num_generated_tokens", 0) > 0 for record in aborted)
        why = stop.name if stop.requested else "another process's signal"
        print(
            f"paxkv: {why}: {len(records) - len(aborted) - num_failed} of {len(records)} requests finished; "
            f"{started} aborted mid-generation and {len(aborted) - started} never started (finish_reason "
            f'"abort"). Rerun the same command with --resume to finish them.',
            file=sys.stderr,
        )
        sys.exit(stop.exit_code if stop.requested else 1)


def run():
    """Console-script entry point."""
    # absl's --help lists the main module's flags, and under the `paxkv` script that module is the script itself,
    # which defines none: make this module's flags (and the config fields' ones) the script's own.
    from paxkv.entrypoints import config_flags

    for module in (sys.modules[__name__], config_flags, serve_command):
        for flag in FLAGS.get_key_flags_for_module(module):
            FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    main_module = sys.modules["__main__"]
    if not main_module.__doc__:  # --help starts with the main module's docstring: this one's examples
        main_module.__doc__ = __doc__
    app.run(main)


if __name__ == "__main__":
    run()
