"""Multi-host runs with JAX's multi-controller runtime: start-up, and what processes agree on.

Every process runs the same deterministic scheduler over the same requests, so each makes the same
decisions and the mesh's collectives line up. Process 0 reads the requests and broadcasts them;
page counts are agreed as the minimum (differing counts compile different programs and hang the
mesh: tpu-inference PR #3429); only process 0 writes outputs and metrics.
"""

import json
import logging
import os
import socket
import time

import jax
import numpy as np

logger = logging.getLogger(__name__)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_seconds: int = 300,
    auto_detect: bool = False,
) -> bool:
    """Join a multi-process run; return whether one was started.

    With `coordinator_address` (host:port), `num_processes` and `process_id` this process joins that
    run; when none is given they come from PAXKV_COORDINATOR_ADDRESS, PAXKV_NUM_PROCESSES and
    PAXKV_PROCESS_ID if set. With `auto_detect` (TPU pods, SLURM and the like) JAX finds them itself.
    With neither, nothing happens: a single-process run.

    Args:
      coordinator_address: process 0's host:port; every process gives the same one.
      num_processes: how many processes take part.
      process_id: this process's index in [0, num_processes).
      timeout_seconds: how long to wait for the coordinator before failing.
      auto_detect: let jax.distributed find the cluster (TPU pod slices, SLURM, ...).
    """
    if coordinator_address is None and num_processes is None and process_id is None:
        from_environment = environment_defaults()
        coordinator_address = from_environment.get("coordinator_address")
        num_processes = from_environment.get("num_processes")
        process_id = from_environment.get("process_id")
    if coordinator_address is None and num_processes is None and process_id is None:
        if not auto_detect:
            return False
        _initialize_jax(timeout_seconds=timeout_seconds)
        return True
    if not coordinator_address:
        raise ValueError(
            "num_processes/process_id were given without a coordinator; pass --coordinator_address=HOST:PORT "
            "(process 0's address, the same on every process)"
        )
    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator_address={coordinator_address!r} is not HOST:PORT, e.g. 10.0.0.1:1234")
    if num_processes is None or process_id is None:
        raise ValueError("a multi-process run needs --num_processes and --process_id on every process")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must lie in [0, num_processes={num_processes})")
    bind = coordinator_address if host in ("127.0.0.1", "localhost") else None
    if process_id != 0:
        # XLA aborts the whole process, with no Python error, when the coordinator never answers: find out first.
        _wait_for_coordinator(host, int(port), timeout_seconds)
    _initialize_jax(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=bind,
        timeout_seconds=timeout_seconds,
    )
    return True


def _wait_for_coordinator(host: str, port: int, timeout_seconds: float) -> None:
    """Return once process 0's coordinator accepts connections; raise a clear error after the timeout."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_seconds)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"could not join the multi-process run at {host}:{port} within {timeout_seconds:g} s: the "
                    f"coordinator does not answer ({e.strerror or e}). Start process 0 (it hosts the coordinator), "
                    "check that the address and port are reachable from every host, and that every process passes "
                    "the same --coordinator_address"
                ) from None
            time.sleep(0.25)


def _initialize_jax(*, timeout_seconds: int, **kwargs) -> None:
    """jax.distributed.initialize, with a failure to reach the coordinator said plainly."""
    try:
        jax.distributed.initialize(initialization_timeout=timeout_seconds, **kwargs)
    except Exception as e:  # XLA raises its own status errors; anything here means the run did not form
        where = kwargs.get("coordinator_address") or "the auto-detected coordinator"
        raise RuntimeError(
            f"could not join the multi-process run at {where} within {timeout_seconds} s: "
            f"{str(e).splitlines()[0][:300]}. Start process 0 (it hosts the coordinator), check the address "
            "and port are reachable from every host, and that every process passes the same "
            "--coordinator_address and --num_processes"
        ) from None
    logger.info(
        "process %d of %d, %d local devices", jax.process_index(), jax.process_count(), jax.local_device_count()
    )


def is_leader() -> bool:
    """Whether this process writes outputs and metrics (process 0)."""
    return jax.process_index() == 0


def broadcast_json(value=None):
    """Process 0's JSON-serializable `value`, on every process (others pass anything, e.g. None)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_leader() else np.zeros(0, np.uint8)
    length = int(multihost_utils.broadcast_one_to_all(np.asarray(len(payload), np.int32)))
    buffer = np.zeros(length, np.uint8)
    buffer[: len(payload)] = payload
    data = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return json.loads(data.tobytes().decode())


def agreed_minimum(value: int) -> int:
    """The smallest of every process's `value` (e.g. the page count each can afford)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray([value], np.int32))))


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process; every process must call it at the same point (e.g. each step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.bool_))))


def environment_defaults() -> dict:
    """Coordinator settings from PAXKV_COORDINATOR_ADDRESS, PAXKV_NUM_PROCESSES and PAXKV_PROCESS_ID, if set."""
    values = {}
    if os.environ.get("PAXKV_COORDINATOR_ADDRESS"):
        values["coordinator_address"] = os.environ["PAXKV_COORDINATOR_ADDRESS"]
    for key, name in (("num_processes", "PAXKV_NUM_PROCESSES"), ("process_id", "PAXKV_PROCESS_ID")):
        text = os.environ.get(name, "").strip()
        if text:
            if not text.isdigit():
                raise ValueError(f"{name}={text!r} is not a non-negative integer")
            values[key] = int(text)
    return values


def host_value(array: jax.Array) -> np.ndarray:
    """An array's value on this host, when other processes hold parts of it too (replicated: any local copy)."""
    if isinstance(array, np.ndarray) or array.is_fully_addressable:
        return np.asarray(array)
    if array.sharding.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def agree_across_processes(num_pages: int, preemption_mode: str) -> tuple[int, str]:
    """What every process of a multi-process run must decide alike: the page count and how to preempt.

    Differing page counts compile differing programs and hang the mesh, so all take the smallest. Choosing
    swap or recompute by measured rates, and copying sharded pages to one host, would differ between
    processes, so a multi-process run preempts by recompute.
    """
    agreed = agreed_minimum(num_pages)
    if agreed < num_pages:
        logger.warning("page pool: %d pages here, %d on another process; all use %d", num_pages, agreed, agreed)
    if preemption_mode == "swap":
        raise ValueError(
            "preemption_mode='swap' is not supported across processes (each holds only its shards of a page); "
            "use 'recompute' or 'auto'"
        )
    if preemption_mode == "auto":
        logger.info("multi-process run: preemption by recompute (rate-based choices would differ between processes)")
    return agreed, "recompute"
