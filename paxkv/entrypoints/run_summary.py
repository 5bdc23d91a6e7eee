"""The batch runner's end-of-run summary: throughput, compile time, KV use, prefix cache and speculation."""

import sys


def run_summary(engine, wall_seconds: float, num_failed: int, compiling) -> dict:
    """The end-of-run summary as a dict.

    Args:
      engine: the run's engine.
      wall_seconds: the run's time.
      num_failed: requests refused.
      compiling: the CompileTotals of the run's own steps.
    """
    metrics = engine.metrics
    tokens = metrics.num_prompt_tokens + metrics.num_generated_tokens
    running = max(wall_seconds - compiling.seconds, 0.0)  # the run's time less its compiles and cache loads

    def rate(count: int, seconds: float) -> float:
        return count / seconds if seconds > 0 else 0.0

    return {
        "requests": metrics.num_finished_requests,
        "rejected_requests": num_failed,
        "prompt_tokens": metrics.num_prompt_tokens,
        "generated_tokens": metrics.num_generated_tokens,
        "wall_seconds": wall_seconds,
        "generated_tokens_per_s": rate(metrics.num_generated_tokens, wall_seconds),
        "total_tokens_per_s": rate(tokens, wall_seconds),
        "compile_seconds": compiling.seconds,
        "programs_compiled": compiling.compiled,
        "programs_from_cache": compiling.cache_hits,
        "generated_tokens_per_s_without_compile": rate(metrics.num_generated_tokens, running),
        "peak_kv_pages_used": metrics.peak_kv_pages_used,
        "kv_pages_total": metrics.num_total_pages,
        "kv_waste_percent": 100 * metrics.kv_waste_fraction,
        "preemptions": metrics.num_preemptions,
        "preemptions_recompute": metrics.num_preemptions_recompute,
        "preemptions_swap": metrics.num_preemptions_swap,
        "kv_bytes_per_token": engine.pool.bytes_per_token,
        "compilations": metrics.num_compilations,
        "prefix_query_tokens": metrics.prefix_query_tokens,
        "prefix_hit_tokens": metrics.prefix_hit_tokens,
        "prefix_hit_percent": 100 * metrics.prefix_hit_rate,
        "kv_pages_cached_idle": metrics.kv_pages_cached_idle,
        "prefix_evictions": metrics.prefix_evictions,
        "draft_tokens": metrics.num_draft_tokens,
        "accepted_draft_tokens": metrics.num_accepted_draft_tokens,
        "rejected_draft_tokens": metrics.num_rejected_draft_tokens,
        "draft_acceptance_percent": 100 * metrics.draft_acceptance_rate,
        "mean_accepted_length": metrics.mean_accepted_length,
        "acceptance_percent_by_position": [100 * rate for rate in metrics.acceptance_by_position],
    }


def print_summary(summary: dict) -> None:
    """The summary's lines on stderr."""
    speculation = ""
    if summary["draft_tokens"]:
        by_position = ", ".join(f"{rate:.0f}%" for rate in summary["acceptance_percent_by_position"])
        speculation = (
            f"\n# speculation: {summary['accepted_draft_tokens']}/{summary['draft_tokens']} drafts accepted "
            f"({summary['draft_acceptance_percent']:.1f}%, {summary['rejected_draft_tokens']} rejected), "
            f"{summary['mean_accepted_length']:.2f} accepted per speculating step; by position {by_position}"
        )
    print(
        f"# {summary['requests']} requests finished, {summary['rejected_requests']} rejected; "
        f"{summary['prompt_tokens']} prompt + {summary['generated_tokens']} generated tokens in "
        f"{summary['wall_seconds']:.1f} s: {summary['generated_tokens_per_s']:.1f} generated tok/s, "
        f"{summary['total_tokens_per_s']:.1f} total tok/s\n"
        f"# compiling: {summary['compile_seconds']:.1f} s of that for {summary['programs_compiled']} programs "
        f"compiled and {summary['programs_from_cache']} loaded from the compilation cache; "
        f"{summary['generated_tokens_per_s_without_compile']:.1f} generated tok/s without it\n"
        f"# KV: peak {summary['peak_kv_pages_used']}/{summary['kv_pages_total']} pages, "
        f"waste {summary['kv_waste_percent']:.1f}%, {summary['preemptions']} preemptions "
        f"({summary['preemptions_recompute']} recompute, {summary['preemptions_swap']} swap)\n"
        f"# prefix cache: {summary['prefix_hit_tokens']}/{summary['prefix_query_tokens']} prompt tokens hit "
        f"({summary['prefix_hit_percent']:.1f}%), {summary['kv_pages_cached_idle']} idle cached pages, "
        f"{summary['prefix_evictions']} evictions" + speculation,
        file=sys.stderr,
    )
