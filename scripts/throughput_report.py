"""The results of scripts/bench_throughput.py: derived ratios and MFU, and the markdown table."""

from throughput_worker import FIRST_TOKENS

MATMUL_SIZE = 2048  # the ceiling's jnp.dot is MATMUL_SIZE x MATMUL_SIZE by MATMUL_SIZE x MATMUL_SIZE


def add_derived(result: dict) -> None:
    """Add MFU and roofline to paxkv rows, and paxkv's speed ratio over each other system at equal model and batch."""
    ceiling = result["roofline_gflops"]
    by_key = {(r["model"], r["batch"], r["system"]): r for r in result["rows"]}
    for row in result["rows"]:
        params = result["params"].get(row["model"])
        if row["system"] == "paxkv" and params:
            flops_per_token = 2 * params
            row["achieved_gflops"] = flops_per_token * row["tokens_per_s"] / 1e9
            row["mfu"] = row["achieved_gflops"] / ceiling
            row["roofline_tokens_per_s"] = ceiling * 1e9 / flops_per_token
        bf16 = by_key.get((row["model"], row["batch"], "paxkv_bf16"))
        if not row["system"].startswith("paxkv") and bf16 is not None:
            row["paxkv_bf16_over_this"] = bf16["tokens_per_s"] / row["tokens_per_s"]
            result["ratios"].append(
                {
                    "model": row["model"],
                    "batch": row["batch"],
                    "ratio": f"paxkv_bf16/{row['system']}",
                    "value": row["paxkv_bf16_over_this"],
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
        f"{result['roofline_gflops']:.0f} GFLOP/s. torch threads: {s['threads']}. "
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
        "TTFT: mean over the batch (transformers: the batch's first token). MFU = 2 x params x tok/s / ceiling.",
        "",
    ]
    with_bf16 = any("paxkv_bf16_over_this" in row for row in result["rows"])
    bf16_header = (" paxkv_bf16 ÷ system |", "---|") if with_bf16 else ("", "")
    lines += [
        f"| model | batch | system | tok/s | paxkv ÷ system |{bf16_header[0]} TTFT (s) | peak RSS (MiB) | MFU |",
        f"|---|---|---|---|---|{bf16_header[1]}---|---|---|",
    ]
    for row in result["rows"]:
        bf16_cell = f" {_fmt(row.get('paxkv_bf16_over_this'), '.2f')} |" if with_bf16 else ""
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['system']} | {row['tokens_per_s']:.1f} | "
            f"{_fmt(row.get('paxkv_over_this'), '.2f')} |{bf16_cell} {_fmt(row['ttft_s'], '.3f')} | "
            f"{row['peak_rss_mib']:.0f} | {_fmt(row.get('mfu'), '.1%')} |"
        )
    if with_bf16:
        lines += ["", "paxkv_bf16: bf16 weights under f32 activations and KV, not an equal-precision peer."]
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
