"""Test setup: CPU only, 8 fake host devices, persistent compilation cache."""

import os

# Must be set before jax initializes its backends.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from paxkv.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()
