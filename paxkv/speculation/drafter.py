"""Drafter: the scheduler's speculation collaborator: proposes each decoding request's drafts and, with the
DraftBudget, decides how many of them the step verifies."""

import dataclasses
import logging
from collections.abc import Callable

from paxkv.config import SpeculativeConfig
from paxkv.scheduling.request import Request
from paxkv.scheduling.scheduled_batch import ScheduledSequence, SpeculatingStep
from paxkv.scheduling.stopping import holds_back_stops
from paxkv.speculation.closed_batch import closed_batch_share
from paxkv.speculation.draft_budget import PRIOR_WEIGHT, DraftBudget, DraftStats
from paxkv.speculation.ngram_proposer import NgramIndex

logger = logging.getLogger(__name__)


def can_speculate(request: Request) -> bool:
    """Whether a request's next tokens may be drafted: sampling that depends on the tokens before it within the
    step (penalties counting them, min_tokens holding stop tokens back) is verified one token at a time."""
    return not request.sampling_params.has_penalties and not holds_back_stops(request)


# What a draft model's drafts are until the model runner fills them in (paxkv.execution.draft_proposer), after
# the scheduler has made room for them. Any token would do: verification is exact whatever the drafts are.
PENDING_DRAFT = 0


class Drafter:
    """Drafts for the decoding requests of one engine (every replica), and their record: prompt-lookup drafts, or
    placeholders for a draft model's (which runs on the devices, after scheduling)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        num_processes: int = 1,
        has_compiled: Callable[[SpeculatingStep], bool] | None = None,
        compile_ahead: Callable[[SpeculatingStep], None] | None = None,
        catch_up_seconds_per_token: Callable[[], float] | None = None,
    ):
        """Args:
        config: the method, draft length and n-gram sizes.
        num_processes: the processes that plan the same batches (jax.process_count()).
        has_compiled: whether a step's programs are compiled (ModelRunner.has_compiled); None: take every step as
          compiled. A step the budget chooses is one compiled: it never waits for a compile.
        compile_ahead: the same -> have such a step's programs compiled in the background
          (ModelRunner.compile_ahead), for the shapes the budget expects to repay it.
        catch_up_seconds_per_token: what a draft model's catch-up is taken to cost per token until one is measured
          (DraftBudget.observe_catch_up); None: nothing.
        """
        if config.adaptive and num_processes > 1:
            # Every process must plan the same batches, and step times differ between hosts: use none of them.
            logger.warning("adaptive speculation decides from local step times; with %d processes it drafts "
                           "every proposal instead", num_processes)  # fmt: skip
            config = dataclasses.replace(config, adaptive=False)
        self.config = config
        self.has_compiled, self.compile_ahead = has_compiled, compile_ahead
        self.catch_up_seconds_per_token = catch_up_seconds_per_token
        self.budget = DraftBudget(adaptive=config.adaptive)
        self._indexes: dict[str, NgramIndex] = {}
        self._stats: dict[str, DraftStats] = {}
        self._kinds: dict[str, int] = {}  # request id -> the kind of its latest proposal (DraftBudget.draft_gains)

    def propose(self, request: Request, max_drafts: int) -> tuple[list[int], int]:
        """Up to `max_drafts` (and num_speculative_tokens) drafts for a decoding request, none where it may not
        speculate or nothing recurs; and the proposal's kind (prompt lookup: the matched suffix's length).

        Args:
          request: a running request with one uncomputed token.
          max_drafts: what its length limits (max_tokens, max_model_len) leave room for.
        """
        config = self.config
        num_drafts = min(config.num_speculative_tokens, max_drafts)
        if num_drafts <= 0 or not can_speculate(request):
            return [], 0
        if config.method == "draft_model":
            return [PENDING_DRAFT] * num_drafts, 0
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        return index.propose(request.prompt_token_ids, request.output_token_ids, num_drafts)

    def choose(
        self,
        sequences: list[ScheduledSequence],
        num_tokens: int,
        token_budget: int,
        max_model_len: int,
        nothing_waiting: bool = False,
    ) -> list[tuple[int, list[int]]]:
        """The drafts worth verifying this step: (index into sequences, drafts) for decoding sequences, as the
        budget approves them against the measured step costs and acceptance rates.

        While requests wait, a row that finishes early is refilled, so every emitted token counts. With nothing
        waiting, the running rows' work ends when the longest of them ends: only drafts of the rows within a draft
        length of the most tokens left count, each as its share of those rows' progress (drafts for a row that
        will finish early anyway make every step dearer and the whole no sooner), and that at the share by which
        the least of their accepted drafts over the rest of the run falls short of the mean
        (paxkv.speculation.closed_batch).

        Args:
          sequences: the step's sequences so far.
          num_tokens: the tokens they run.
          token_budget: tokens the step may still take.
          max_model_len: the most tokens a request may reach.
          nothing_waiting: no request waits for a place in the batch.
        """
        finish_together = nothing_waiting and self.budget.adaptive  # else every proposal is drafted
        rooms = [_room(sequence.request, max_model_len) for sequence in sequences]
        # A draft model first catches up over the tokens a row skipped (DraftModelProposer): a step's catch-ups
        # share one program's token budget, which only the first row catching up may exceed (in catch-up programs
        # of its own), so that rows catch up in their running order and none waits forever.
        catch_up_left, first_catch_up = num_tokens + token_budget, True
        longest = max(rooms, default=0) - self.config.num_speculative_tokens
        num_longest = sum(room >= longest for room in rooms)
        rows, proposals, kinds, catch_ups, remaining_tokens = [], [], [], [], 0
        for index, (sequence, room) in enumerate(zip(sequences, rooms, strict=True)):
            request = sequence.request
            if sequence.num_new_tokens != 1 or not sequence.completes_prompt:
                continue  # prefill chunks verify nothing
            remaining_tokens += room
            if finish_together and room < longest:
                continue  # finishes before the longest row whatever it drafts
            drafts, kind = self.propose(request, room - 1)  # the step emits up to len(drafts) + 1 tokens
            catch_up = request.num_computed_tokens - request.num_draft_computed
            if drafts and self.config.method == "draft_model" and catch_up:
                if catch_up > catch_up_left and not first_catch_up:
                    continue  # catches up in a later step
                catch_up_left, first_catch_up = catch_up_left - catch_up, False
            if drafts:
                rows.append(index)
                proposals.append(drafts)
                kinds.append(kind)
                catch_ups.append(catch_up)
                self._kinds[request.request_id] = kind
        if not rows:
            return []
        candidates = [
            self.budget.draft_gains(self._stats.get(sequences[i].request.request_id, DraftStats()), len(d), kind)
            for i, d, kind in zip(rows, proposals, kinds, strict=True)
        ]
        num_emitting = sum(sequence.completes_prompt for sequence in sequences)
        if finish_together:  # progress is the longest rows' mean, in the units of num_emitting tokens per row
            share = self._closed_batch_share(sequences, rooms, longest, dict(zip(rows, candidates, strict=True)))
            candidates = [[gain * share * num_emitting / num_longest for gain in gains] for gains in candidates]
        compiled = compile_ahead = None
        prefills = any(sequence.num_new_tokens > 1 for sequence in sequences)
        params = [sequence.request.sampling_params for sequence in sequences]
        variant = any(p.logprobs is not None for p in params), all(p.greedy for p in params)  # the sampling's
        # What a draft model runs for each candidate row that drafts: its catch-up and its last token.
        spans = [catch_up + 1 if self.config.method == "draft_model" else 0 for catch_up in catch_ups]

        def step(counts: list[int]) -> SpeculatingStep:  # the step with these drafts
            num_drafts = sum(counts)
            draft_spans = tuple(span for span, count in zip(spans, counts, strict=True) if count and span)
            return SpeculatingStep(num_tokens + num_drafts, len(sequences), prefills, num_drafts, *variant, draft_spans)

        if self.has_compiled is not None:

            def compiled(counts: list[int]) -> bool:
                return self.has_compiled(step(counts))

        if self.compile_ahead is not None:

            def compile_ahead(counts: list[int]) -> None:
                self.compile_ahead(step(counts))

        entry_costs = None  # a draft model's catch-ups: a request's whole prompt the first time it drafts
        if self.config.method == "draft_model" and self.catch_up_seconds_per_token is not None:
            per_token = self.budget.catch_up_seconds_per_token(self.catch_up_seconds_per_token())
            entry_costs = [catch_up * per_token for catch_up in catch_ups]
        counts = self.budget.allot(
            num_tokens,
            num_emitting,
            candidates,
            token_budget,
            compiled,
            remaining_tokens,
            compile_ahead,
            entry_costs,
        )
        return [(i, d[:c]) for i, d, c in zip(rows, proposals, counts, strict=True) if c]

    def _closed_batch_share(
        self, sequences: list[ScheduledSequence], rooms: list[int], longest: int, gains: dict[int, list[float]]
    ) -> float:
        """closed_batch_share for the decoding rows within a draft length of the most tokens left: each accepting
        drafts a step at its record's rate (its accepted drafts over its steps), shrunk toward what this step's
        proposal is expected to add (none without one)."""
        rates, steps_left = [], []
        for index, (sequence, room) in enumerate(zip(sequences, rooms, strict=True)):
            if room < longest or sequence.num_new_tokens != 1 or not sequence.completes_prompt:
                continue
            request = sequence.request
            stats = self._stats.get(request.request_id, DraftStats())
            steps = request.num_output_tokens - stats.num_accepted  # each emitted one token and its accepted drafts
            prior = sum(gains.get(index, ()))
            rates.append((stats.num_accepted + PRIOR_WEIGHT * prior) / (max(steps, 0) + PRIOR_WEIGHT))
            steps_left.append(room / (1.0 + rates[-1]))  # its tokens left, at 1 + rate a step
        if not rates:
            return 0.0
        return closed_batch_share(len(rates), sum(rates) / len(rates), sum(steps_left) / len(steps_left))

    def observe_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Record a step's verdict on a request's drafts."""
        stats = self._stats.setdefault(request.request_id, DraftStats())
        self.budget.observe_verified(stats, num_drafts, num_accepted, self._kinds.get(request.request_id, 0))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's index and record."""
        self._indexes.pop(request_id, None)
        self._stats.pop(request_id, None)
        self._kinds.pop(request_id, None)

    def counts(self) -> dict:
        """What the metrics report: drafts verified and accepted, rows that verified any, and both per position."""
        budget = self.budget
        return dict(
            num_draft_tokens=budget.num_drafts,
            num_accepted_draft_tokens=budget.num_accepted,
            num_speculative_rows=budget.num_verifying_rows,
            drafted_by_position=list(budget.drafted_by_position),
            accepted_by_position=list(budget.accepted_by_position),
        )


def _room(request: Request, max_model_len: int) -> int:
    """The most tokens a request may still emit."""
    return min(request.sampling_params.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens)
