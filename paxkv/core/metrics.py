"""EngineMetrics: the engine's counters and KV-pool gauges, kept in one place."""

import dataclasses
import time


@dataclasses.dataclass
class EngineMetrics:
    """What the engine has done so far and how full its page pool is.

    KV waste is allocated-but-unfilled token slots as a share of allocated slots, summed over steps (so a
    step with more pages in use weighs more). With paging it is at most one partial page per sequence.
    """

    num_total_pages: int  # usable pages (the null page excluded)
    page_size: int
    num_requests: int = 0  # accepted by add_request
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    num_prompt_tokens: int = 0  # of finished requests
    num_generated_tokens: int = 0  # every token sampled, finished requests or not
    num_computed_tokens: int = 0  # tokens whose KV the steps computed, recomputation after preemption included
    num_steps: int = 0
    num_preemptions: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_pages_swapped: int = 0  # pages moved between device and host, either way
    num_compilations: int = 0
    kv_pages_used: int = 0  # pages some request holds (shared pages count once)
    peak_kv_pages_used: int = 0
    kv_pages_cached_idle: int = 0  # pages only the prefix cache holds: resident, reclaimable by eviction
    kv_pages_cached: int = 0  # pages the prefix cache holds, idle or not
    prefix_query_tokens: int = 0  # prompt tokens looked up at first admission (not after preemption)
    prefix_hit_tokens: int = 0  # of those, found in the cache
    prefix_evictions: int = 0
    allocated_slot_steps: int = 0  # sum over steps of allocated token slots
    unfilled_slot_steps: int = 0  # sum over steps of allocated but unfilled token slots
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_draft_tokens: int = 0  # of those, accepted
    num_speculative_rows: int = 0  # sequence-steps that verified at least one draft
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)  # [j]: drafts at place j of a step
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)  # [j]: of those, accepted
    busy_seconds: float = 0.0  # wall time inside step() with work to do
    first_step_time: float | None = None
    last_step_time: float | None = None

    @property
    def kv_pages_free(self) -> int:
        """Pages on the free list now (idle cached pages are not free until evicted)."""
        return self.num_total_pages - self.kv_pages_used - self.kv_pages_cached_idle

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the prefix cache."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def num_rejected_draft_tokens(self) -> int:
        """Verified drafts that were not accepted."""
        return self.num_draft_tokens - self.num_accepted_draft_tokens

    @property
    def draft_acceptance_rate(self) -> float:
        """Share of verified speculative drafts accepted."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted per sequence-step that verified any (each such step emits this many plus one)."""
        return self.num_accepted_draft_tokens / self.num_speculative_rows if self.num_speculative_rows else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """[j]: the share of drafts at place j of their step that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)]

    @property
    def kv_waste_fraction(self) -> float:
        """Allocated but unfilled KV slots as a share of allocated slots, over all steps so far."""
        return self.unfilled_slot_steps / self.allocated_slot_steps if self.allocated_slot_steps else 0.0

    @property
    def elapsed_seconds(self) -> float:
        """Wall time from the start of the first step to the end of the last."""
        if self.first_step_time is None or self.last_step_time is None:
            return 0.0
        return self.last_step_time - self.first_step_time

    @property
    def generated_tokens_per_s(self) -> float:
        """Generated tokens per second of busy time (inside steps that had work; idle gaps do not count)."""
        return self.num_generated_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0

    @property
    def computed_tokens_per_s(self) -> float:
        """Prompt and generated tokens through the model per second of busy time, recomputation included."""
        return self.num_computed_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0

    def observe(self, scheduler) -> None:
        """Refresh what the scheduler counts: pages requests hold, the prefix caches' pages and hits, preemptions.

        Args:
          scheduler: the engine's paxkv.scheduling.scheduler.Scheduler.
        """
        self.kv_pages_used = scheduler.num_request_pages
        # Every allocated page is held by a request, or else only by a prefix cache (idle).
        self.kv_pages_cached_idle = scheduler.num_used_pages - self.kv_pages_used
        self.kv_pages_cached = scheduler.num_cached_pages
        self.prefix_evictions = scheduler.num_evictions
        self.prefix_query_tokens = scheduler.num_prefix_query_tokens
        self.prefix_hit_tokens = scheduler.num_prefix_hit_tokens
        self.num_preemptions = scheduler.num_preemptions
        self.num_preemptions_recompute = scheduler.num_preemptions_by_kind["recompute"]
        self.num_preemptions_swap = scheduler.num_preemptions_by_kind["swap"]
        for name, value in scheduler.speculation_counts.items():
            setattr(self, name, value)

    def record_step(
        self, start: float, scheduler, num_tokens: int, peak_kv_pages: int, finished: list, num_generated: int
    ) -> None:
        """Account one step that began at `start` (time.monotonic) and has just ended.

        Args:
          start: when the step began.
          scheduler: the engine's Scheduler, after the step's update.
          num_tokens: tokens the step ran through the model.
          peak_kv_pages: pages requests held during the step, before finished requests freed theirs.
          finished: the request groups (paxkv.core.output_processor) that finished in the step.
          num_generated: tokens the step emitted (accepted drafts included, non-finite placeholders not).
        """
        end = time.monotonic()
        self.observe(scheduler)
        allocated, filled = scheduler.kv_slots
        self.num_steps += 1
        self.num_computed_tokens += num_tokens
        self.num_finished_requests += len(finished)
        self.num_prompt_tokens += sum(len(group.prompt_token_ids) for group in finished)
        self.num_generated_tokens += num_generated
        self.busy_seconds += end - start
        if self.first_step_time is None:
            self.first_step_time = start
        self.last_step_time = end
        self.peak_kv_pages_used = max(self.peak_kv_pages_used, self.kv_pages_used, peak_kv_pages)
        self.allocated_slot_steps += allocated
        self.unfilled_slot_steps += allocated - filled

    def as_dict(self) -> dict:
        """Every counter and derived value, for JSON."""
        values = dataclasses.asdict(self)
        for name in ("first_step_time", "last_step_time"):
            values.pop(name)
        values.update(
            kv_pages_free=self.kv_pages_free,
            prefix_hit_rate=self.prefix_hit_rate,
            kv_waste_fraction=self.kv_waste_fraction,
            num_rejected_draft_tokens=self.num_rejected_draft_tokens,
            draft_acceptance_rate=self.draft_acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            elapsed_seconds=self.elapsed_seconds,
            generated_tokens_per_s=self.generated_tokens_per_s,
            computed_tokens_per_s=self.computed_tokens_per_s,
        )
        return values
