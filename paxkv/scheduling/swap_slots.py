"""The host swap pool's free list: which slots hold a swapped-out page (bookkeeping only; the copies are
execution.swap's)."""


class HostSlotAllocator:
    """The host pool's free list: which swap slots hold a swapped-out page. Host-side bookkeeping only."""

    def __init__(self, num_slots: int):
        """Creates a free list of `num_slots` slots (0 disables swapping).

        Args:
          num_slots: host page slots.
        """
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        """Slots free now."""
        return len(self._free)

    def allocate(self, num_slots: int) -> list[int]:
        """Takes `num_slots` free slots; raises ValueError if there are fewer."""
        if num_slots > len(self._free):
            raise ValueError(f"cannot take {num_slots} swap slots: only {len(self._free)} are free")
        slots = self._free[len(self._free) - num_slots :][::-1]
        del self._free[len(self._free) - num_slots :]
        return slots

    def free(self, slots: list[int]) -> None:
        """Returns slots to the free list."""
        self._free.extend(slots)
