"""`paxkv serve`: the OpenAI-compatible HTTP server (paxkv.serving) on uvicorn, with every engine flag of the batch
command line.

    paxkv serve                                  # the embedded SmolLM2 on http://127.0.0.1:8000
    paxkv serve --model ./Llama-3.2-1B --port 8080 --api_key "$KEY" --max_num_seqs 64
"""

import os
import sys

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to bind (loopback by default; 0.0.0.0 for every one).")
flags.DEFINE_integer("port", 8000, "serve: the TCP port.")
flags.DEFINE_multi_string(
    "api_key",
    None,
    "serve: require Authorization: Bearer <key> with this key (repeatable; default $PAXKV_API_KEY, comma-separated).",
)
flags.DEFINE_bool("salt_by_api_key", False, "serve: give each API key its own prefix-cache salt (no shared pages).")
flags.DEFINE_string("served_model_name", None, "serve: the model's name in the API (default: the checkpoint's).")
flags.DEFINE_integer(
    "max_waiting_requests", 1024, "serve: requests not yet running beyond which the server answers 503."
)
flags.DEFINE_string("max_request_size", "8MiB", "serve: the largest request body (413 beyond).")
flags.DEFINE_bool("access_log", False, "serve: log every HTTP request.")
flags.DEFINE_bool(
    "warmup", True, "serve: compile every step bucket before listening, so no request waits for a compile."
)


def api_keys() -> tuple[str, ...]:
    """--api_key, else $PAXKV_API_KEY split on commas; () for an open server."""
    keys = FLAGS.api_key or [key for key in os.environ.get("PAXKV_API_KEY", "").split(",")]
    return tuple(key.strip() for key in keys if key.strip())


def served_model_name(source: str | None) -> str:
    """--served_model_name, else the checkpoint's folder or file name without its extension."""
    if FLAGS.served_model_name:
        return FLAGS.served_model_name
    base = os.path.basename(os.path.normpath(source)) if source else "paxkv"
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def serve(usage_error) -> None:
    """Load the model, start the engine thread and serve until SIGINT or SIGTERM.

    Args:
      usage_error: reports a bad flag and exits (the batch command line's).
    """
    if (FLAGS.num_processes or 1) > 1 or FLAGS.coordinator_address or FLAGS.distributed_auto:
        usage_error(
            "serve runs in one process: serving across hosts (process 0 broadcasting each step's requests) is not "
            "available yet; serve a model that fits one host's devices (--mesh), or run batch jobs across hosts "
            "with --prompts_file"
        )
    import uvicorn

    from paxkv.config import EngineConfig, LoadConfig
    from paxkv.entrypoints.config_flags import config_from_flags, parse_memory_size
    from paxkv.entrypoints.engine_loading import start_command_line_engine
    from paxkv.serving.api_server import ServerConfig, build_app
    from paxkv.serving.engine_loop import EngineLoop

    try:
        engine_config = config_from_flags(EngineConfig)
        load_config = config_from_flags(LoadConfig)
        max_request_bytes = parse_memory_size(FLAGS.max_request_size)
    except ValueError as e:
        usage_error(str(e))
    if load_config.skip_tokenizer_init:
        usage_error("serve needs the model's tokenizer (for text and chat); drop --skip_tokenizer_init")
    engine = start_command_line_engine(FLAGS.model, engine_config, load_config, FLAGS.compilation_cache_dir)
    loaded = engine.loaded
    config = ServerConfig(
        model_name=served_model_name(FLAGS.model or loaded.source),
        max_model_len=engine.max_model_len,
        api_keys=api_keys(),
        salt_by_api_key=FLAGS.salt_by_api_key,
        max_waiting_requests=FLAGS.max_waiting_requests,
        max_request_bytes=max_request_bytes,
    )
    if config.salt_by_api_key and not config.api_keys:
        usage_error("--salt_by_api_key needs API keys (--api_key or $PAXKV_API_KEY)")
    if FLAGS.warmup:
        num_shapes, seconds = engine.warm_up()
        shapes = f"{num_shapes} step shape" + ("" if num_shapes == 1 else "s")
        print(f"# warm-up: {shapes} compiled or loaded in {seconds:.1f} s", file=sys.stderr)
    loop = EngineLoop(engine).start()
    app = build_app(loop, loaded.tokenizer, config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Abort what runs first, so open streams end now (finish_reason "abort") and uvicorn need not wait.
            loop.stop(timeout=0)
            super().handle_exit(sig, frame)

    print(
        f"# serving {config.model_name!r} ({loaded.config.num_layers} layers, context {config.max_model_len}) on "
        f"http://{FLAGS.host}:{FLAGS.port}/v1{' (API key required)' if config.api_keys else ''}",
        file=sys.stderr,
    )
    server = Server(
        uvicorn.Config(app, host=FLAGS.host, port=FLAGS.port, access_log=FLAGS.access_log, log_level="info")
    )
    try:
        server.run()
    finally:
        loop.stop()
