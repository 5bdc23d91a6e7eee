"""Swap space: a host (numpy) pool of page slots, and the device<->host page copies of preemption by swap."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_forward import bucket
from pallas_kernels import write_pages
from paxkv.scheduling.swap_slots import HostSlotAllocator


def _padded(indices: list[int]) -> tuple[jax.Array, int]:
    """Indices padded with 0 to a power of two (bounding compilations), and the true count."""
    size = bucket(len(indices))
    return jnp.asarray(list(indices) + [0] * (size - len(indices)), jnp.int32), len(indices)


@jax.jit
def _gather(kv_caches, pages):
    return jax.tree.map(lambda pool: pool[pages], kv_caches)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("native",))
def _scatter(kv_caches, pages, values, native: bool = False):
    # Padding entries write page 0, the null page, whose content nobody reads.
    return jax.tree.map(lambda pool, value: write_pages(pool, pages, value, native=native), kv_caches, values)


class HostSwapSpace:
    """Host copies of whole pages, one numpy array per leaf of the device pool (8-bit scales included).

    Pages move device -> host when a request is preempted by swap and host -> device, into whatever
    pages are free then, when it resumes. The copies are bit-exact. Transfer rates are measured on
    every move, for the preemption cost model.
    """

    def __init__(self, kv_caches, num_slots: int):
        """Allocates the host pool (numpy; the OS maps it lazily, so unused slots cost no RAM).

        Args:
          kv_caches: the device pool (per layer, any pytree whose leaves have the page on axis 0).
          num_slots: host page slots.
        """
        self.slots = HostSlotAllocator(num_slots)
        leaves = jax.tree.leaves(kv_caches)
        self._host = [np.empty((num_slots, *leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        self.bytes_per_page = sum(leaf.dtype.itemsize * int(np.prod(leaf.shape[1:])) for leaf in leaves)
        self.bytes_moved = 0
        self.seconds_moving = 0.0

    @property
    def bytes_per_second(self) -> float | None:
        """Measured transfer rate over every move so far; None before the first."""
        return self.bytes_moved / self.seconds_moving if self.seconds_moving > 0 else None

    def swap_out(self, kv_caches, pages: list[int], slots: list[int]) -> None:
        """Copy device `pages` into host `slots` (the device pool is left as it is).

        Args:
          kv_caches: the device pool.
          pages, slots: equal-length lists.
        """
        start = time.perf_counter()
        indices, count = _padded(pages)
        gathered = jax.device_get(jax.tree.leaves(_gather(kv_caches, indices)))
        for host, values in zip(self._host, gathered, strict=True):
            host[slots] = values[:count]
        self._account(count, start)

    def swap_in(self, kv_caches, slots: list[int], pages: list[int], *, native: bool = False):
        """Copy host `slots` into device `pages`; returns the new device pool (the old one is donated).

        Args:
          kv_caches: the device pool.
          slots, pages: equal-length lists.
          native: the pool is on one CPU device whose model runs the native kernels (pallas_kernels.write_pages).
        """
        start = time.perf_counter()
        indices, count = _padded(pages)
        size = indices.shape[0]
        values = []
        for host in self._host:
            block = np.zeros((size, *host.shape[1:]), host.dtype)
            block[:count] = host[slots]
            values.append(block)
        treedef = jax.tree.structure(kv_caches)
        kv_caches = _scatter(kv_caches, indices, jax.tree.unflatten(treedef, values), native)
        jax.block_until_ready(kv_caches)
        self._account(count, start)
        return kv_caches

    def _account(self, num_pages: int, start: float) -> None:
        self.bytes_moved += num_pages * self.bytes_per_page
        self.seconds_moving += time.perf_counter() - start
