"""The `pressure` workload of bench_memory.py: paged vs contiguous, FP8 vs bf16, overload, page-size sweep.

Parts (a), (b) and the waste columns of (d) are exact arithmetic over a length distribution, with pages
handed out by paxkv's own PageAllocator; (c) and the throughput column of (d) run the engine.
"""

import math
import time

import numpy as np

from paxkv.scheduling.page_allocator import OutOfPagesError, PageAllocator

PAGE_SIZES = (4, 8, 16, 32, 64, 128)


def lognormal_lengths(count: int, mean: float, cap: int, seed: int) -> np.ndarray:
    """Sequence lengths (prompt + output) from a lognormal with the given mean (sigma 1), capped."""
    sigma = 1.0
    mu = math.log(mean) - sigma**2 / 2
    lengths = np.random.default_rng(seed).lognormal(mu, sigma, count)
    return np.clip(np.round(lengths), 1, cap).astype(int)


def paged_fill(lengths: np.ndarray, budget_tokens: int, page_size: int) -> int:
    """Sequences admitted in order, each holding its whole length, until the allocator runs out."""
    allocator = PageAllocator(budget_tokens // page_size + 1)
    for count, length in enumerate(lengths):
        try:
            allocator.allocate(-(-int(length) // page_size))
        except OutOfPagesError:
            return count
    return len(lengths)


def paged_vs_contiguous(lengths: np.ndarray, budget_tokens: int, max_model_len: int, page_size: int) -> dict:
    """(a): KV waste and concurrency of contiguous max_model_len slots against pages, at one token budget."""
    pages = -(-lengths // page_size)
    return {
        "budget_tokens": budget_tokens,
        "contiguous_waste": float(1 - lengths.sum() / (len(lengths) * max_model_len)),
        "paged_waste": float(1 - lengths.sum() / (pages.sum() * page_size)),
        "contiguous_concurrency": budget_tokens // max_model_len,
        "paged_concurrency": paged_fill(lengths, budget_tokens, page_size),
        "paged_mean_concurrency": float(budget_tokens / (pages.mean() * page_size)),
    }


def concurrency_curve(lengths, budgets_bytes, bytes_per_token: dict[str, int], max_model_len, page_size) -> list[dict]:
    """Concurrent sequences against the KV budget for contiguous bf16, paged bf16 and paged FP8."""
    rows = []
    for budget in budgets_bytes:
        bf16_tokens = budget // bytes_per_token["bfloat16"]
        fp8_tokens = budget // bytes_per_token["fp8_e4m3"]
        rows.append(
            {
                "budget_gib": budget / 2**30,
                "contiguous": bf16_tokens // max_model_len,
                "paged": paged_fill(lengths, bf16_tokens, page_size),
                "paged_fp8": paged_fill(lengths, fp8_tokens, page_size),
            }
        )
    return rows


def page_size_waste(lengths: np.ndarray, page_sizes=PAGE_SIZES) -> list[dict]:
    """(d) without the model: KV waste and block-table entries per sequence for each page size."""
    rows = []
    for page_size in page_sizes:
        pages = -(-lengths // page_size)
        rows.append(
            {
                "page_size": page_size,
                "waste": float(1 - lengths.sum() / (pages.sum() * page_size)),
                "block_table_entries": float(pages.mean()),
            }
        )
    return rows


def decode_throughput(loaded, page_size: int, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens per second at `batch` on this backend's attention path, prefill excluded."""
    from paxkv.config import EngineConfig
    from paxkv.core.engine import Engine
    from paxkv.scheduling.sampling_params import SamplingParams

    config = EngineConfig(
        page_size=page_size,
        num_pages=batch * -(-(prompt_len + new_tokens) // page_size) + 8,
        max_num_seqs=batch,
        max_num_batched_tokens=max(1024, batch),
        enable_prefix_caching=False,
    )
    engine = Engine(loaded, config)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index in range(batch):
        engine.add_request(str(index), rng.integers(100, loaded.config.vocab_size, prompt_len).tolist(), params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill, and the first token of each
    engine.step()  # compile the decode shape outside the timing
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += len(engine.step())
    return generated / (time.perf_counter() - start)


def overload(loaded, num_requests: int, fraction_of_demand: float, seed: int) -> list[dict]:
    """(c): requests against a pool of a fraction of their demand, under recompute, swap and auto, in one run."""
    from paxkv.config import EngineConfig
    from paxkv.core.engine import Engine
    from paxkv.scheduling.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    page_size, new_tokens = 16, 32
    prompt_lengths = rng.integers(16, 160, num_requests)
    prompts = [rng.integers(100, loaded.config.vocab_size, int(n)).tolist() for n in prompt_lengths]
    demand = sum(-(-(int(n) + new_tokens) // page_size) for n in prompt_lengths)
    num_pages = max(int(demand * fraction_of_demand), 64)
    modes = ("recompute", "swap", "auto")

    def engine_for(mode):
        config = EngineConfig(
            page_size=page_size,
            num_pages=num_pages,
            max_num_seqs=min(256, num_pages - 1),  # KVPool needs a page per sequence; 64 pages (the floor) hold 63
            max_num_batched_tokens=1024,
            preemption_mode=mode,
            enable_prefix_caching=False,
        )
        return Engine(loaded, config)

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    # Warm-up, untimed: every mode first runs half the workload (twice the pool, so it preempts), which
    # compiles its step shapes and page-moving programs before any mode is timed.
    for mode in modes:
        engine = engine_for(mode)
        for index, prompt in enumerate(prompts[: num_requests // 2]):
            engine.add_request(str(index), prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    rows = []
    for mode in modes:
        engine = engine_for(mode)
        start = time.perf_counter()
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, params)
        finished = 0
        while engine.has_unfinished_requests():
            finished += sum(o.finished for o in engine.step())
        seconds = time.perf_counter() - start
        metrics = engine.metrics
        rows.append(
            {
                "mode": mode,
                "finished": finished,
                "pool_pages": num_pages - 1,
                "demand_pages": demand,
                "seconds": seconds,
                "generated_tokens_per_s": metrics.num_generated_tokens / seconds,
                "preemptions_recompute": metrics.num_preemptions_recompute,
                "preemptions_swap": metrics.num_preemptions_swap,
                "pages_swapped": metrics.num_pages_swapped,
                "recomputed_tokens": metrics.num_computed_tokens
                - sum(map(len, prompts))
                - num_requests * (new_tokens - 1),
            }
        )
    return rows
