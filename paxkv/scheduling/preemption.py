"""Choosing how to preempt: recompute a victim's tokens later, or swap its pages to the host and back, by cost."""

import logging

logger = logging.getLogger(__name__)

# Estimates used until the engine has measured its own rates.
_DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
_DEFAULT_TRANSFER_BYTES_PER_S = 2e9
_DEFAULT_SWAP_LATENCY_S = 1e-3
# Weight of a new measurement in the running averages.
_SMOOTHING = 0.3


class PreemptionPolicy:
    """Recompute or swap, by the estimated seconds each costs.

    Recompute costs the victim's tokens that the prefix cache will not give back, at the measured
    prefill rate. Swap costs its pages' bytes both ways at the measured transfer rate, plus a fixed
    latency per move. `auto` picks the cheaper; swap needs room in the host pool either way.
    """

    def __init__(self, mode: str, bytes_per_page: int, num_host_slots: int):
        """Creates a policy for one engine.

        Args:
          mode: auto | recompute | swap.
          bytes_per_page: device bytes of one page over every layer (8-bit scales included).
          num_host_slots: pages the host pool holds; 0 means recompute always.
        """
        self.mode = mode
        self.bytes_per_page = bytes_per_page
        self.num_host_slots = num_host_slots
        self.prefill_tokens_per_s = _DEFAULT_PREFILL_TOKENS_PER_S
        self.transfer_bytes_per_s = _DEFAULT_TRANSFER_BYTES_PER_S
        self.swap_latency_s = _DEFAULT_SWAP_LATENCY_S
        self._measured_prefill = self._measured_transfer = False

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold in one step's rate (the engine calls this for steps that are mostly prefill)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        weight = _SMOOTHING if self._measured_prefill else 1.0
        self.prefill_tokens_per_s += weight * (rate - self.prefill_tokens_per_s)
        self._measured_prefill = True

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        """Fold in one swap's measured rate."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        weight = _SMOOTHING if self._measured_transfer else 1.0
        self.transfer_bytes_per_s += weight * (rate - self.transfer_bytes_per_s)
        self._measured_transfer = True

    def recompute_seconds(self, num_tokens: int) -> float:
        """Estimated time to recompute `num_tokens` tokens."""
        return num_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_pages: int) -> float:
        """Estimated time to move `num_pages` pages out and back in."""
        return 2 * (num_pages * self.bytes_per_page / self.transfer_bytes_per_s + self.swap_latency_s)

    def choose(self, num_tokens_to_recompute: int, num_pages: int, num_free_host_slots: int) -> str:
        """ "swap" or "recompute" for one victim.

        Args:
          num_tokens_to_recompute: its computed tokens the prefix cache would not give back.
          num_pages: pages it holds (what a swap moves).
          num_free_host_slots: host slots free now.
        """
        if self.mode == "recompute" or num_pages > num_free_host_slots or num_pages == 0:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        if self.swap_seconds(num_pages) < self.recompute_seconds(num_tokens_to_recompute):
            return "swap"
        return "recompute"
