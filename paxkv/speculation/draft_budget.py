"""How many drafts to verify per step: expected accepted tokens against the measured cost of a bigger step.

Drafts are extra query tokens of the ragged step, so speculation pays where a step's cost grows slowly with its
token count (decoding is memory-bound at small batches) and loses where it is compute-bound (large batches).
The budget measures that cost curve as it runs, per padded token bucket and per (token bucket, draft bucket), and
how often the draft at each place of a step stands (drafts stand or fall together: a copy that goes well goes well
for several tokens, so the rate of the j-th is measured, not taken as the first's to the j-th power), and per step
drafts the tokens that raise the expected tokens per second, most likely first, or none.

Acceptance is recorded per kind of proposal as well: for prompt lookup, the length of the suffix that matched.
A 4-token match in a request that quotes its prompt and a 1-token match by chance in open text stand at very
different rates, and one engine serves both: with a single record, requests of one kind would be drafted at the
other's rate. A kind's record starts from the other kinds' (shrunk toward the prior), and each request's drafts
are scaled by how its own accepted drafts compare with what the records expected of them.

A step shape with no compiled program yet also costs a compile (seconds for a 30-layer model on CPU), which the
step-cost curve does not show. The budget never runs such a step: it has the shape compiled on a worker thread
(paxkv.execution.ahead_compiler) and takes it once ready, and only where the drafts would repay that compile, at
the shape's estimated cost and against the best compiled choice (beating it by more than the estimates' error,
COMPILE_MARGIN), over the tokens the running rows still have to emit plus as many as the engine has emitted so far:
the work to come is taken to be as large as the work done (a ski-rental rule: a long-lived engine learns every
shape worth having, and one short call never pays for a compile it cannot win back, which still takes CPU time
from the steps while it runs).

A cost is the least of its shape's latest samples, but a shape that samples taken while a compile ran make dear
would never run again to correct it: such a compiled choice is retried while it could be the best at the least cost
its smaller measured shapes allow (EXPLORE_SAMPLES, EXPLORE_FLOOR).
"""

import collections
import dataclasses
from collections.abc import Callable

from models.paged_forward import bucket

# Records start at the prior, weighted as this many drafts (a request's scale: as this many expected acceptances).
PRIOR_WEIGHT = 2.0
PRIOR_ACCEPTANCE = 0.5
# A cost is the least of this many latest step times of its key: what slows a step besides its own work (a
# page-copy program compiling, a collection, another process) only ever adds time, and one such step among few
# samples would move a mean or a median (a plain step once measured 15x its cost that way).
COST_WINDOW = 8
# What a compile is taken to cost before one is measured.
DEFAULT_COMPILE_SECONDS = 1.0
# A step shape measured only while a compile shared the CPU (which doubled a decode step's time on two cores) keeps
# that dear time until it runs again uncontended, and a choice it makes dear would never run again (prompt lookup at
# batch 8 on copy drafted nearly nothing where drafting always gained 21%). Such a compiled choice, if it could be
# the best at no more than the least cost its smaller measured shapes allow, is run again (up to this many samples)
# where it measured at least EXPLORE_FLOOR of the best rate: a retry loses at most half a step's tokens. Retrying
# every shape measured fewer than three times (at a floor of 0.5, or 0.8 for uncontended ones) cost open prompts
# 3-5% (at batch 32, 0.94x and 0.96x against 0.99x), so uncontended samples are trusted.
EXPLORE_SAMPLES = 3
EXPLORE_FLOOR = 0.5
# A shape is compiled ahead only where its expected rate beats the best compiled choice's by at least this much. The
# cost of a shape not yet run is a guess, optimistic by design (step_cost), and a measured one carries the machine's
# noise (5-8% between two identical engines on two cores): at batch 32, prompt lookup on copy at temperature 0.8 asked
# for shapes that promised 2% and 6% more tokens a second, as the engine's emitted tokens doubled, and the one that
# ran measured 14% dearer than its guess (slower than plain steps), while each compile took the two cores from the
# steps for 2-3 s (0.96x against plain decoding).
COMPILE_MARGIN = 0.1


@dataclasses.dataclass
class DraftStats:
    """One request's record: drafts verified and accepted, and the acceptances the records expected of them."""

    num_drafts: int = 0
    num_accepted: int = 0
    num_expected: float = 0.0


class DraftBudget:
    """Per step, the drafts worth verifying: an online model of step cost per token bucket and of acceptance."""

    def __init__(self, adaptive: bool = True):
        """Args:
        adaptive: decide from the measurements; False drafts every proposed token.
        """
        self.adaptive = adaptive
        self.step_seconds: dict[int, float] = {}  # padded token bucket -> step time (COST_WINDOW), any drafts
        self.program_seconds: dict[tuple[int, int], float] = {}  # (token bucket, draft bucket) -> step time
        self._samples: dict[tuple, collections.deque[float]] = {}  # (table, key) -> its latest step times
        self._contended: set[tuple] = set()  # (table, key) measured only while a compile shared the CPU
        self.compile_seconds = DEFAULT_COMPILE_SECONDS  # mean time of the steps that compiled
        self._catch_up_samples: collections.deque[float] = collections.deque(maxlen=COST_WINDOW)
        self.num_compiled_steps = 0
        self.num_emitted = 0  # tokens the engine has emitted so far
        self.num_drafts = 0
        self.num_accepted = 0
        self.num_verifying_rows = 0  # sequence-steps that verified at least one draft
        self.drafted_by_position: list[int] = []  # [j]: drafts verified at place j of their step
        self.accepted_by_position: list[int] = []  # [j]: of those, accepted
        # kind -> ([j]: drafts of that kind verified at place j, [j]: of those, accepted)
        self.by_kind: dict[int, tuple[list[int], list[int]]] = {}

    def standing(self, kind: int, num_drafts: int) -> list[float]:
        """[j]: the chance that the j-th of a proposal's drafts and all before it stand, from the per-place record
        of proposals of this kind, shrunk toward the other kinds' record, itself shrunk toward
        PRIOR_ACCEPTANCE^(j+1) while it is short; never rising with j."""
        drafted_kind, accepted_kind = self.by_kind.get(kind, ([], []))
        rates, previous = [], 1.0
        for j in range(num_drafts):
            drafted = _at(self.drafted_by_position, j) - _at(drafted_kind, j)
            accepted = _at(self.accepted_by_position, j) - _at(accepted_kind, j)
            others = (accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE ** (j + 1)) / (drafted + PRIOR_WEIGHT)
            rate = (_at(accepted_kind, j) + PRIOR_WEIGHT * others) / (_at(drafted_kind, j) + PRIOR_WEIGHT)
            previous = min(previous, rate)
            rates.append(previous)
        return rates

    def draft_gains(self, stats: DraftStats, num_drafts: int, kind: int = 0) -> list[float]:
        """[j]: the expected tokens the j-th of a request's drafts adds: the chance that it and all before it stand
        (standing), scaled by the request's accepted drafts over those the records expected of it (1 while it has
        few), at most 1 and never rising with j.

        Args:
          stats: the request's record.
          num_drafts: its proposal's drafts.
          kind: what kind of proposal it is (prompt lookup: the matched suffix's length; a draft model: 0).
        """
        scale = (stats.num_accepted + PRIOR_WEIGHT) / (stats.num_expected + PRIOR_WEIGHT)
        gains, previous = [], 1.0
        for rate in self.standing(kind, num_drafts):
            previous = min(previous, rate * scale, 1.0)
            gains.append(previous)
        return gains

    def observe_verified(self, stats: DraftStats, num_drafts: int, num_accepted: int, kind: int = 0) -> None:
        """Record that a request's step verified `num_drafts` drafts of a proposal of `kind` and accepted
        `num_accepted`."""
        stats.num_expected += sum(self.standing(kind, num_drafts))
        stats.num_drafts += num_drafts
        stats.num_accepted += num_accepted
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        self.num_verifying_rows += 1
        drafted_kind, accepted_kind = self.by_kind.setdefault(kind, ([], []))
        for counts, upto in (
            (self.drafted_by_position, num_drafts),
            (self.accepted_by_position, num_accepted),
            (drafted_kind, num_drafts),
            (accepted_kind, num_accepted),
        ):
            counts.extend([0] * (num_drafts - len(counts)))
            for j in range(upto):
                counts[j] += 1

    def observe_step(self, num_tokens: int, seconds: float, num_drafts: int = 0, contended: bool = False) -> None:
        """Record a step's wall time (steps that compiled should not be given), keyed by its token count's bucket, and
        by that and its draft count's bucket: drafts add rows of logits and sampling that a step of as many tokens
        without them does not pay.

        Args:
          num_tokens, num_drafts: the step's tokens (drafts included) and drafts.
          seconds: its wall time.
          contended: a compile ran in the background meanwhile, so the time overstates the step's: it counts only
            for a key with no other measurement yet (a pessimistic cost beats an optimistic guess), until the
            first uncontended one replaces it.
        """
        for name, table, key in (
            ("tokens", self.step_seconds, bucket(num_tokens)),
            ("program", self.program_seconds, _program(num_tokens, num_drafts)),
        ):
            samples = self._samples.setdefault((name, key), collections.deque(maxlen=COST_WINDOW))
            if contended:
                if samples and (name, key) not in self._contended:
                    continue
                self._contended.add((name, key))
            elif (name, key) in self._contended:
                self._contended.discard((name, key))
                samples.clear()
            samples.append(seconds)
            table[key] = min(samples)

    def observe_compile(self, seconds: float) -> None:
        """Record the wall time of a step that compiled its program (what trying an unseen shape costs)."""
        self.num_compiled_steps += 1
        known = self.compile_seconds if self.num_compiled_steps > 1 else seconds
        self.compile_seconds = known + (seconds - known) / self.num_compiled_steps

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        """Record a draft model's fill that caught it up over `num_tokens` tokens (its drafting included, a small
        part where the catch-up is long) in `seconds`."""
        self._catch_up_samples.append(seconds / num_tokens)

    def catch_up_seconds_per_token(self, default: float) -> float:
        """What a draft model's catch-up costs per token: the least of the latest measured, else `default`."""
        return min(self._catch_up_samples, default=default)

    def observe_emitted(self, num_tokens: int) -> None:
        """Record the tokens a step emitted."""
        self.num_emitted += num_tokens

    def repays_compile(self, expected: float, cost: float, best_rate: float | None, remaining_tokens: int) -> bool:
        """Whether a step emitting `expected` tokens in `cost` seconds, against the best rate available without
        compiling (tokens per second), would save more than a compile over `remaining_tokens` tokens and as many as
        the engine has emitted so far, and beats that rate by at least COMPILE_MARGIN."""
        if best_rate is None or cost <= 0:
            return False  # nothing to compare with yet
        if expected / cost < (1.0 + COMPILE_MARGIN) * best_rate:
            return False  # within the estimates' error: the compile would likely buy nothing
        saving = (remaining_tokens + self.num_emitted) * (1.0 / best_rate - cost / expected)
        return saving > self.compile_seconds

    def step_cost(self, num_tokens: int, num_drafts: int = 0) -> float | None:
        """The expected time of a step of `num_tokens` tokens, `num_drafts` of them drafts: as measured for its token
        and draft buckets where it was. Else from the token buckets: its own; else on the line between the measured
        buckets around it; the bucket just above the largest measured one costs the same as that one (optimistic:
        it is tried once, and then known), and any bucket beyond is None (not tried before the one below it is
        known); and never less than a measured step of no more tokens and no more drafts costs, nor than the line
        from the plain step of its T bucket to a measured one with more drafts. 0 where nothing is measured yet.

        Step costs are not linear in the tokens (on CPU a one-row matmul is a matrix-vector product and two rows
        are not), so the curve is measured rather than extrapolated, one bucket at a time: learning costs one
        bigger step, and one compilation, per bucket.
        """
        program = _program(num_tokens, num_drafts)
        measured = self.program_seconds.get(program)
        if measured is not None:
            return measured
        estimate = self._token_curve(bucket(num_tokens))
        if estimate is None:
            return None
        known = self.program_seconds.items()
        smaller = [seconds for (t, r), seconds in known if t <= program[0] and r <= program[1]]
        # Draft rows cost about in proportion to their number: a measured step of the same T and more of them, and
        # the plain one, bound this one from below (a plain step's cost alone would take them to be free).
        plain = self.program_seconds.get((program[0], 0))
        if plain is not None:
            tokens, drafts = program
            smaller += [plain + (s - plain) * drafts / r for (t, r), s in known if t == tokens and r > drafts]
        return max([estimate, *smaller])

    def _token_curve(self, key: int) -> float | None:
        """step_cost from the token buckets alone (any drafts)."""
        known = self.step_seconds
        if key in known:
            return known[key]
        if not known:
            return 0.0
        below = [k for k in known if k < key]
        above = [k for k in known if k > key]
        if below and above:
            low, high = max(below), min(above)
            return known[low] + (known[high] - known[low]) * (key - low) / (high - low)
        if not below:  # smaller than every measured bucket: at most the smallest one's cost
            return known[min(above)]
        return known[max(below)] if key == 2 * max(below) else None

    def allot(
        self,
        num_tokens: int,
        num_emitting: int,
        candidates: list[list[float]],
        room: int,
        compiled: Callable[[list[int]], bool] | None = None,
        remaining_tokens: int = 0,
        compile_ahead: Callable[[list[int]], None] | None = None,
        entry_costs: list[float] | None = None,
    ) -> list[int]:
        """How many drafts each candidate verifies this step.

        Drafts are taken in order of their expected gain (draft_gains), and the count chosen maximizes (emitted
        tokens) / (step cost) over the token buckets it spans, among the counts whose step has a compiled program:
        a step never waits for a compile. The best choice whose programs are not compiled yet, if it would beat that
        and repay its compile (repays_compile), is handed to `compile_ahead`, for later steps. None until the step
        without drafts has been measured (once anything has been). A compiled choice measured only while a compile
        ran may be run instead (_retry).

        Args:
          num_tokens: tokens the step runs before any drafts.
          num_emitting: rows that emit a token this step without drafts.
          candidates: per decoding row, the gain of each draft it proposes (non-increasing).
          room: the most drafts the token budget allows.
          compiled: drafts per candidate -> whether the step with them has compiled programs; None: all have.
          remaining_tokens: tokens the decoding rows may still emit (what a compile is repaid over).
          compile_ahead: drafts per candidate -> have the programs of the step with them compiled in the
            background.
          entry_costs: per candidate, seconds it costs before its first draft (a draft model catching up over the
            tokens it skipped, its prompt the first time): a choice whose candidates cost more than it saves over
            `remaining_tokens`, against plain steps, is no choice; None: none.
        """
        if not self.adaptive:
            counts, left = [], room
            for row_gains in candidates:
                counts.append(min(len(row_gains), left))
                left -= counts[-1]
            return counts
        if self.step_seconds and _program(num_tokens, 0) not in self.program_seconds:
            # Drafts are judged against this step without them, measured, not against a guess from other buckets
            # (a guess from a bigger step's cost, once drafting began at the first decode step, made plain
            # decoding look as dear as drafting: a target-sized draft model drafted at batch 32 at 0.6x).
            return [0] * len(candidates)
        # Most likely first; among equal gains, a candidate's earlier drafts first.
        ranked = ((gain, -j, row) for row, row_gains in enumerate(candidates) for j, gain in enumerate(row_gains))
        gains = [(gain, row) for gain, _, row in sorted(ranked, reverse=True)][:room]
        # (drafts per candidate, expected tokens, step cost, compiled?) at the last count of each program's buckets
        # (within them the cost is flat: only the last count can be the best), up to the first bucket beyond an
        # unmeasured one.
        options, expected, counts = [], float(num_emitting), [0] * len(candidates)
        for count, (gain, row) in enumerate(gains, start=1):
            expected += gain
            counts[row] += 1
            program = _program(num_tokens + count, count)
            if count < len(gains) and _program(num_tokens + count + 1, count + 1) == program:
                continue
            cost = self.step_cost(num_tokens + count, count)
            if cost is None:
                break
            if entry_costs is not None and not self._repays_entry(counts, entry_costs, expected, cost, num_tokens,
                                                                   num_emitting, remaining_tokens):  # fmt: skip
                continue
            options.append((list(counts), expected, cost, compiled is None or compiled(list(counts))))
        base_cost = self.step_cost(num_tokens)
        best, best_rate = [0] * len(candidates), num_emitting / base_cost if base_cost else None
        for counts, expected, cost, ready in options:
            if not ready:
                continue
            if best_rate is None or cost <= 0:  # nothing measured yet: try it, and learn
                best, best_rate = counts, None
            elif expected / cost > best_rate:
                best, best_rate = counts, expected / cost
        retry = self._retry(options, num_tokens, best_rate)
        if compile_ahead is not None:
            wanted = [
                (expected / cost, counts)
                for counts, expected, cost, ready in options
                if not ready and self.repays_compile(expected, cost, best_rate, remaining_tokens)
            ]
            if wanted:
                compile_ahead(max(wanted)[1])
        return best if retry is None else retry

    def _retry(self, options: list[tuple], num_tokens: int, best_rate: float | None) -> list[int] | None:
        """The compiled choice to run again instead of the best (EXPLORE_SAMPLES): measured only while a compile ran,
        fewer than EXPLORE_SAMPLES times, at no less than EXPLORE_FLOOR of the best rate, and the best at the least
        cost it could have; the likeliest such choice to win, or None."""
        if best_rate is None:
            return None
        retries = []
        for counts, expected, cost, ready in options:
            program = _program(num_tokens + sum(counts), sum(counts))
            if not ready or ("program", program) not in self._contended or expected / cost < EXPLORE_FLOOR * best_rate:
                continue
            if len(self._samples[("program", program)]) >= EXPLORE_SAMPLES:
                continue
            least = self._least_cost(program)
            if least and expected / least > best_rate:
                retries.append((expected / cost, counts))
        return max(retries)[1] if retries else None

    def _least_cost(self, program: tuple[int, int]) -> float:
        """What a step of this program costs at least, by the measured programs of no more tokens and drafts (a
        bigger step is no cheaper), its own samples left out; 0 where none is measured."""
        tokens, drafts = program
        known = self.program_seconds.items()
        return max((s for (t, r), s in known if t <= tokens and r <= drafts and (t, r) != program), default=0.0)

    def _repays_entry(
        self,
        counts: list[int],
        entry_costs: list[float],
        expected: float,
        cost: float,
        num_tokens: int,
        num_emitting: int,
        remaining_tokens: int,
    ) -> bool:
        """Whether drafting `counts` saves more than the drafting candidates' entry costs over `remaining_tokens`
        tokens, against plain steps (emitting `expected` tokens in `cost` seconds a step)."""
        entry = sum(seconds for seconds, count in zip(entry_costs, counts, strict=True) if count)
        if entry <= 0:
            return True
        base_cost = self.step_cost(num_tokens)
        if not base_cost or cost <= 0:
            return False
        return remaining_tokens * (base_cost / num_emitting - cost / expected) > entry


def _at(counts: list[int], j: int) -> int:
    """counts[j], or 0 past its end."""
    return counts[j] if j < len(counts) else 0


def _program(num_tokens: int, num_drafts: int) -> tuple[int, int]:
    """A step's (token bucket, draft bucket): what its cost is measured by (0 for no drafts)."""
    return bucket(num_tokens), bucket(num_drafts) if num_drafts else 0
