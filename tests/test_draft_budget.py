"""The draft budget and the drafter's choice, without a model: step costs, compiles, acceptance per kind of proposal,
processes that plan together, and closed batches."""

import pytest

from paxkv.config import SpeculativeConfig
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ScheduledSequence
from paxkv.speculation.draft_budget import EXPLORE_FLOOR, EXPLORE_SAMPLES, DraftBudget, DraftStats
from paxkv.speculation.drafter import Drafter


def test_the_budget_drafts_only_where_the_measured_step_costs_pay():
    flat = DraftBudget()
    for tokens in (4, 8, 16, 32):
        flat.observe_step(tokens, 0.010)  # memory-bound: a bigger step costs the same
    likely, never = [0.8, 0.6, 0.5, 0.4], [0.0] * 4  # each draft's expected gain
    assert flat.allot(4, 4, [likely] * 4, room=100) == [4, 4, 4, 4]
    assert flat.allot(4, 4, [never] * 4, room=100) == [0, 0, 0, 0]  # drafts that never stand gain nothing
    assert sum(flat.allot(4, 4, [likely] * 4, room=5)) == 5  # within the token budget
    steep = DraftBudget()
    for tokens in (32, 64, 128):
        steep.observe_step(tokens, 0.010 * tokens / 32)  # compute-bound: cost grows with the tokens
    assert steep.allot(32, 32, [likely] * 32, room=400) == [0] * 32
    exploring = DraftBudget()
    exploring.observe_step(32, 0.100)
    assert sum(exploring.allot(32, 32, [likely] * 32, room=400)) == 32  # one bucket up (64 tokens), no further
    exploring.observe_step(64, 0.190)  # it cost nearly twice as much; 128 tokens might still pay: tried next
    assert sum(exploring.allot(32, 32, [likely] * 32, room=400)) == 96
    exploring.observe_step(128, 0.380)
    assert sum(exploring.allot(32, 32, [likely] * 32, room=400)) == 0  # measured: none pays
    # Drafts add rows of logits: a program measured with them costs what it measured, not its T's plain cost.
    with_rows = DraftBudget()
    with_rows.observe_step(8, 0.010)
    with_rows.observe_step(16, 0.010)  # plain steps of 8 and 16 tokens cost the same
    assert sum(with_rows.allot(8, 8, [likely] * 8, room=8)) == 8
    with_rows.observe_step(16, 0.030, num_drafts=8)  # with 8 drafts the 16-token step took three times as long
    assert sum(with_rows.allot(8, 8, [likely] * 8, room=8)) == 0
    # Unmeasured, a step of more tokens and drafts costs at least what that one did.
    assert with_rows.step_cost(24, num_drafts=16) == pytest.approx(0.030)
    # And one with fewer drafts costs at least its share of the measured drafts' cost over the plain step's.
    assert with_rows.step_cost(12, num_drafts=4) == pytest.approx(0.020)
    unknown = DraftBudget()
    assert unknown.allot(2, 2, [[0.5, 0.25]] * 2, room=10) == [2, 2]  # nothing measured: try, and learn
    # Drafting began at once: the plain step is measured before drafts are judged against it, never guessed from
    # the drafting steps' cost (which made plain decoding look as dear as drafting).
    unknown.observe_step(8, 1.0, num_drafts=6)  # 2 rows and 6 drafts: a dear step
    assert unknown.allot(2, 2, [[1.0] * 3] * 2, room=10) == [0, 0]
    unknown.observe_step(2, 0.1)
    assert unknown.allot(2, 2, [[1.0] * 3] * 2, room=10) == [0, 0]  # 8 tokens a second against 20
    cheap = DraftBudget()
    cheap.observe_step(8, 0.2, num_drafts=6)
    cheap.observe_step(2, 0.1)
    assert cheap.allot(2, 2, [[1.0] * 3] * 2, room=10) == [3, 3]  # 40 tokens a second against 20
    assert DraftBudget(adaptive=False).allot(32, 32, [[0.0] * 3] * 2, room=4) == [3, 1]
    # Gains per place are measured: drafts that stand together make the fourth nearly as likely as the first.
    budget = DraftBudget()
    stats = [DraftStats() for _ in range(50)]
    for index, row in enumerate(stats):
        budget.observe_verified(row, 4, 4 if index % 2 else 0)  # all four stand, or none
    gains = budget.draft_gains(DraftStats(), 4)
    assert 0.45 < gains[3] <= gains[0] < 0.55  # where 0.5 ** 4 would say 0.06
    rejected = DraftBudget()
    rejected.observe_verified(DraftStats(), 3, 0)
    assert rejected.draft_gains(DraftStats(), 2) == pytest.approx([1 / 3, 1 / 6])  # the prior, shrunk by one miss


def test_a_choice_measured_dear_only_while_a_compile_ran_is_run_again_while_it_could_win():
    """Samples taken while a compile shared the CPU may double a step's time: a compiled choice measured only so, which
    would be the best at the least cost its smaller shapes allow, is retried (up to EXPLORE_SAMPLES samples) while it
    measured within EXPLORE_FLOOR of the best rate; an uncontended sample is trusted."""
    likely = [[0.9] * 4] * 8  # 8 rows decoding, 4 drafts each: 8 + 28.8 tokens expected from a 40-token step

    def allot(budget):  # only the step with every draft (and the plain one) is compiled, as in an engine
        return budget.allot(8, 8, likely, room=32, compiled=lambda counts: sum(counts) in (0, 32))

    def measured(*drafting_seconds, contended=True):
        budget = DraftBudget()
        budget.observe_step(8, 0.010)  # plain steps: 800 tokens a second
        for seconds in drafting_seconds:
            budget.observe_step(40, seconds, num_drafts=32, contended=contended)
        return budget

    assert allot(measured(0.030)) == [4] * 8  # 1227 tokens a second: the best as measured
    assert 36.8 / 0.060 >= EXPLORE_FLOOR * 800
    slow_spell = measured(0.060)  # 613 tokens a second while a compile ran: worse than plain steps
    assert allot(slow_spell) == [4] * 8  # but it could cost as little as a plain step: run again
    slow_spell.observe_step(40, 0.012, num_drafts=32)  # its real cost, uncontended, replaces the contended ones
    assert allot(slow_spell) == [4] * 8  # now the best as measured
    assert allot(measured(0.060, contended=False)) == [0] * 8  # an uncontended time is trusted
    dear = measured(0.060)
    for _ in range(EXPLORE_SAMPLES - 1):
        assert allot(dear) == [4] * 8
        dear.observe_step(40, 0.060, num_drafts=32, contended=True)  # while compiles keep running
    assert allot(dear) == [0] * 8  # measured enough: no more retries
    assert allot(measured(0.100)) == [0] * 8  # 368 a second: below EXPLORE_FLOOR of the best rate
    # Nor is a choice that could not win at its least cost: here a plain 40-token step bounds it from below.
    bounded = measured(0.060)
    bounded.observe_step(40, 0.050)
    assert 36.8 / 0.050 < 800 and allot(bounded) == [0] * 8


def test_acceptance_is_learned_per_kind_of_proposal_and_per_request():
    """Long prompt-lookup matches that stand do not make chance 1-token matches look as good, and the reverse."""
    budget = DraftBudget()
    for _ in range(40):  # a copying workload: 4-token matches, every draft stands
        budget.observe_verified(DraftStats(), 4, 4, kind=4)
    assert budget.draft_gains(DraftStats(), 4, kind=4)[3] > 0.9
    unseen = budget.draft_gains(DraftStats(), 4, kind=1)
    assert unseen[0] > 0.6  # an unseen kind starts from what the others did
    for _ in range(10):  # open text: 1-token matches by chance, none stands
        budget.observe_verified(DraftStats(), 4, 0, kind=1)
    # 10 misses against a prior of 2 drafts at the copies' rate (41 / 42): 2 * (41 / 42) / 12.
    assert budget.draft_gains(DraftStats(), 4, kind=1)[0] == pytest.approx(2 * (41 / 42) / 12)
    assert budget.draft_gains(DraftStats(), 4, kind=4)[3] > 0.9  # the copies' record is untouched
    # A request whose drafts stand less often than the records expected is scaled down, and the reverse.
    doubted, trusted = DraftStats(), DraftStats()
    for _ in range(5):
        budget.observe_verified(doubted, 4, 0, kind=4)
        budget.observe_verified(trusted, 4, 4, kind=1)
    assert doubted.num_expected > 15 and trusted.num_expected < 10  # against 0 and 20 accepted
    assert budget.draft_gains(doubted, 1, kind=4)[0] < 0.2
    assert budget.draft_gains(DraftStats(), 1, kind=1)[0] < 0.5 < budget.draft_gains(trusted, 1, kind=1)[0] == 1.0


def test_the_budget_runs_only_compiled_steps_and_compiles_ahead_only_where_the_work_repays_it():
    likely = [0.9, 0.9, 0.9, 0.9]
    budget = DraftBudget()
    budget.observe_step(8, 0.010)
    budget.observe_step(16, 0.010)
    budget.observe_compile(2.0)  # a compile costs 200 plain steps here
    ready, wanted = {8}, []  # only the program of 16 tokens with 8 drafts exists

    def allot(remaining_tokens):  # the callbacks take drafts per candidate
        ask = lambda counts: wanted.append(sum(counts))  # noqa: E731
        counts = budget.allot(8, 8, [likely] * 8, room=100, compiled=lambda counts: sum(counts) in ready,
                              remaining_tokens=remaining_tokens, compile_ahead=ask)  # fmt: skip
        return sum(counts)

    # 8 drafts ride the compiled 16-token program; 24 (a 32-token step, not compiled, hoped to cost what 16 tokens
    # do) would emit ~1.9x as many tokens a step, too little over 100 tokens to repay a compile, enough over 10000.
    # A step never waits for that compile: it runs the 8 drafts, and the 24's program is compiled for later steps.
    assert allot(remaining_tokens=100) == 8 and wanted == []
    assert allot(remaining_tokens=10_000) == 8 and wanted == [24]
    budget.observe_emitted(10_000)  # what the engine emitted so far counts as work to come
    assert allot(remaining_tokens=100) == 8 and wanted == [24, 24]
    ready.add(24)  # compiled now: taken, and nothing more asked for
    assert allot(remaining_tokens=100) == 24 and wanted == [24, 24]
    # Without compiled programs of any drafts, a measured plain step: none drafted, the best one asked for.
    ready.clear()
    assert allot(remaining_tokens=100) == 0 and wanted[-1] == 24
    # A choice that promises less than COMPILE_MARGIN over the best compiled one is never compiled, however much
    # work is left: its cost is a guess, and the compile would likely buy nothing.
    assert budget.repays_compile(8 * 1.2, 0.010, 800.0, remaining_tokens=10**6)
    assert not budget.repays_compile(8 * 1.05, 0.010, 800.0, remaining_tokens=10**6)
    budget.observe_emitted(10**9)
    assert not budget.repays_compile(8 * 1.05, 0.010, 800.0, remaining_tokens=10**6)
    # Nothing compiled and nothing measured to compare against: no compile, no drafts.
    fresh = DraftBudget()
    asked = []
    counts = fresh.allot(2, 2, [[0.5, 0.25]] * 2, room=10, compiled=lambda c: False, remaining_tokens=10**6,
                         compile_ahead=asked.append)  # fmt: skip
    assert counts == [0, 0] and asked == []
    # The mean time of the steps that compiled is what a compile is taken to cost.
    fresh.observe_compile(1.0)
    fresh.observe_compile(3.0)
    assert fresh.compile_seconds == pytest.approx(2.0)


def test_processes_that_plan_together_draft_every_proposal(caplog):
    """Step times differ between hosts, and every process must plan the same batches: with several processes the
    budget drafts every proposal instead of deciding from local times, and says so."""
    assert Drafter(SpeculativeConfig(method="ngram")).budget.adaptive
    with caplog.at_level("WARNING"):
        drafter = Drafter(SpeculativeConfig(method="ngram"), num_processes=2)
    assert not drafter.config.adaptive and not drafter.budget.adaptive
    assert "with 2 processes it drafts every proposal" in caplog.text


def test_with_nothing_waiting_only_the_rows_with_the_most_left_draft():
    """A closed batch ends with its longest row: drafts for rows that finish earlier make steps dearer for nothing."""
    params = SamplingParams(temperature=0.0, max_tokens=100)
    sequences = []
    for index, num_output in enumerate([10, 12, 30, 50]):  # 90, 88, 70 and 50 tokens left
        request = Request(str(index), [5, 6, 7] * 10, params)
        request.output_token_ids = [5] * num_output  # "5" recurs: every row has a proposal
        request.num_computed_tokens = request.num_tokens - 1
        sequences.append(ScheduledSequence(request, [5], [request.num_tokens - 1], [0], [0], request.num_tokens, True))
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4))  # nothing measured: it tries

    def drafted_rows(nothing_waiting):
        return [index for index, _ in drafter.choose(sequences, 4, 64, 1000, nothing_waiting)]

    assert drafted_rows(False) == [0, 1, 2, 3]  # requests wait: every emitted token counts
    assert drafted_rows(True) == [0, 1]  # within 4 drafts of the 90 tokens the longest has left
    drafter.budget.adaptive = False  # drafting every proposal means every one
    assert drafted_rows(True) == [0, 1, 2, 3]


def test_a_draft_models_catch_ups_share_the_token_budget_in_running_order():
    """A draft model catches a row up over the tokens it skipped before it drafts: a step's catch-ups take at most
    its token budget, except the first row catching up, whatever its size (so none waits forever); rows whose
    draft KV is complete draft whatever the catch-ups took."""
    params = SamplingParams(temperature=0.0, max_tokens=100)
    sequences = []
    for index, skipped in enumerate([0, 90, 30, 0, 20, 10]):  # tokens each row's draft KV lacks
        request = Request(str(index), list(range(100)), params)
        request.num_computed_tokens = request.num_tokens - 1
        request.num_draft_computed = request.num_computed_tokens - skipped
        sequences.append(ScheduledSequence(request, [5], [request.num_tokens - 1], [0], [0], request.num_tokens, True))
    config = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=2, adaptive=False)
    drafter = Drafter(config)
    # A budget of 64 (4 tokens so far): row 1's 90 go first; then rows 2 and 4 do not fit, and row 5's 10 would not.
    assert [index for index, _ in drafter.choose(sequences, 4, 60, 1000)] == [0, 1, 3]
    sequences[1].request.num_draft_computed = sequences[1].request.num_computed_tokens  # caught up
    assert [index for index, _ in drafter.choose(sequences, 4, 60, 1000)] == [0, 1, 2, 3, 4, 5]  # 60 of 64


def test_a_draft_model_catches_up_only_where_its_drafts_repay_the_catch_up():
    """A row whose draft KV lags (its prompt, the first time it drafts) first costs the draft's catch-up over those
    tokens: drafts for it are chosen only where they save more than that over the tokens still to come."""
    budget = DraftBudget()
    budget.observe_step(8, 0.100)
    budget.observe_step(16, 0.100, num_drafts=8)  # drafts cost nothing more: 8 + 8 x 0.9 tokens a step, not 8
    likely = [0.9]
    entry = [2.0] + [0.0] * 7  # row 0 catches up over 1000 tokens at 2 ms each

    def drafted(remaining_tokens, entry_costs):
        return budget.allot(8, 8, [likely] * 8, room=8, remaining_tokens=remaining_tokens, entry_costs=entry_costs)

    # A step saves 1 - 8 / 15.2 of its 0.1 s, 0.0059 s a token, against plain steps: 2 s repaid over 340 tokens.
    assert drafted(100, None) == [1] * 8 == drafted(100, [0.0] * 8)
    assert drafted(100, entry)[0] == 0 < sum(drafted(100, entry))  # the others draft (fewer: a smaller program)
    assert drafted(1000, entry) == [1] * 8
    assert budget.catch_up_seconds_per_token(default=0.5) == 0.5  # nothing measured
    budget.observe_catch_up(1000, 3.0)
    budget.observe_catch_up(1000, 2.0)
    assert budget.catch_up_seconds_per_token(default=0.5) == pytest.approx(0.002)
