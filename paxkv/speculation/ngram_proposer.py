"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a request's newest n tokens.

Each request keeps an index, n-gram -> where its latest occurrence ended, for every n in [min_n, max_n]. It is
brought up to date with the tokens appended since the last proposal, so a proposal costs O(new tokens x n range)
dictionary operations however long the context is, instead of a rescan of the whole sequence per step.
"""

from collections.abc import Sequence


class NgramIndex:
    """One request's n-gram index over its prompt and output tokens (which only ever grow)."""

    __slots__ = ("min_n", "max_n", "_latest_end", "_num_indexed")

    def __init__(self, min_n: int, max_n: int):
        """Args:
        min_n, max_n: the n-gram lengths to match, longest first (1 <= min_n <= max_n).
        """
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # _latest_end[n - min_n][ngram] = e: the latest occurrence of the n tokens ngram is tokens[e - n : e].
        self._latest_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        # Occurrences ending at 1.._num_indexed are in the index.
        self._num_indexed = 0

    def propose(self, prompt: Sequence[int], output: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        """Up to `num_tokens` drafts following the latest earlier occurrence of the longest suffix that recurs, and
        that suffix's length (0 for none): a longer match is likelier to continue as it did before.

        The continuation wraps around when it reaches the end (a repeating loop continues repeating), so a match
        always gives num_tokens drafts; no match gives none.

        Args:
          prompt, output: the request's tokens so far (the index assumes they only grow between calls).
          num_tokens: the most drafts wanted.
        """
        num_prompt, length = len(prompt), len(prompt) + len(output)

        def token(i: int) -> int:
            return prompt[i] if i < num_prompt else output[i - num_prompt]

        # Index every occurrence that ends before the newest token, so the suffix never matches itself.
        for end in range(self._num_indexed + 1, length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._latest_end[n - self.min_n][tuple(token(i) for i in range(end - n, end))] = end
        self._num_indexed = max(self._num_indexed, length - 1)
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._latest_end[n - self.min_n].get(tuple(token(i) for i in range(length - n, length)))
            if end is None:
                continue
            drafts: list[int] = []
            for i in range(num_tokens):  # past the last token, continue with the drafts themselves
                position = end + i
                drafts.append(token(position) if position < length else drafts[position - length])
            return drafts, n
        return [], 0
