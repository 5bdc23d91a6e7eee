"""Speculative decoding without a model: the n-gram index against a rescan, and verification's acceptance counts
against a loop (the engine's side: test_speculative.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxkv.execution.verification import DraftRows, count_accepted, emitted_candidates
from paxkv.speculation.ngram_proposer import NgramIndex


def rescan_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """The proposal by a full rescan: the longest recurring suffix, its latest earlier end, wrapped past the end;
    and that suffix's length."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        ends = [e for e in range(n, length) if tokens[e - n : e] == suffix]
        if ends:
            virtual = list(tokens)
            for i in range(k):
                virtual.append(virtual[max(ends) + i])
            return virtual[length:], n
    return [], 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_the_index_proposes_what_a_rescan_finds_as_tokens_arrive(tokens, growth, max_n, extra):
    """Grown step by step (prompt first, then outputs), the index agrees with a rescan of everything each time."""
    min_n, max_n = max(1, max_n - extra), max_n
    index = NgramIndex(min_n, max_n)
    prompt, output = tokens[:5], []
    rest = tokens[5:]
    for size in [0, *growth]:
        output += rest[:size]
        rest = rest[size:]
        assert index.propose(prompt, output, 5) == rescan_proposal(prompt + output, min_n, max_n, 5)


def test_the_index_prefers_the_longest_match_and_continues_a_loop():
    index = NgramIndex(1, 3)
    # "7 8 9" recurs: after "... 7 8 9" comes "4"; the 1-gram "9" alone would also match the first "9 4".
    assert index.propose([7, 8, 9, 4, 5, 9, 6, 7, 8, 9], [], 3) == ([4, 5, 9], 3)
    assert NgramIndex(1, 2).propose([1, 2, 1, 2], [], 5) == ([1, 2, 1, 2, 1], 2)  # a loop keeps looping
    assert NgramIndex(1, 2).propose([1, 2, 3], [], 4) == ([], 0)  # nothing recurs
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramIndex(3, 2)


def test_acceptance_counts_leading_matches_per_row_like_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(20):
        num_rows = int(rng.integers(1, 6))
        counts = rng.integers(0, 4, num_rows)
        rows = np.repeat(np.arange(num_rows), counts)
        index = np.concatenate([np.arange(c) for c in counts]) if counts.sum() else np.zeros(0, int)
        drafts = rng.integers(0, 3, len(rows))
        samples = rng.integers(0, 3, len(rows))
        padding = 8 - len(rows) % 8
        draft_rows = DraftRows(
            logits_indices=np.zeros(len(rows) + padding, np.int32),
            tokens=np.concatenate([drafts, np.full(padding, -2)]).astype(np.int32),
            rows=np.concatenate([rows, np.full(padding, num_rows)]).astype(np.int32),
            index=np.concatenate([index, np.zeros(padding)]).astype(np.int32),
            sampling=None,
        )
        samples = np.concatenate([samples, np.zeros(padding)]).astype(np.int32)
        expected = []
        for row in range(num_rows):
            accepted = 0
            for j in np.flatnonzero(rows == row):
                if samples[j] != drafts[j]:
                    break
                accepted += 1
            expected.append(accepted)
        assert count_accepted(samples, draft_rows, num_rows).tolist() == expected
    assert (
        emitted_candidates(3, 1) == [1, 2] and emitted_candidates(2, 2) == [1, 2, 0] and emitted_candidates(0, 0) == [0]
    )
