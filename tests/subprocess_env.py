"""The environment of the processes tests start: one CPU device unless told, and the tests' quick compiles."""

import os

# XLA:CPU flags that change how a program compiles, not what it computes (the HLO is the same, and every comparison
# in the suite holds under them). The tests' time goes mostly to compiling many small programs: 80 of
# test_preemption's 92 s. LLVM's optimization level 0 compiles them about a fifth faster, and the legacy elemental
# emitters instead of the fusion emitters halve what is left (a 2-layer model's engine step: 0.7 s to 0.33 s).
# One LLVM module per program, not several compiled on parallel threads: the two test workers already keep both
# cores busy, and splitting costs more than it gains then (test_preemption.py alone: 44 s to 40 s;
# the whole suite, 504 s to 489 s).
COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
# For SmolLM2's 30 layers the legacy emitters cost more than they save (a CLI chat run: 12.1 s without them,
# 15.7 s with), so processes that run it keep the fusion emitters.
LARGE_MODEL_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"


def subprocess_env(*, large_model: bool = False, **overrides: str) -> dict:
    """os.environ with XLA_FLAGS set to the compile flags alone (no forced host device count), plus `overrides`.

    Args:
      large_model: the process runs SmolLM2 or larger (LARGE_MODEL_COMPILE_FLAGS).
      **overrides: further environment variables.
    """
    flags = LARGE_MODEL_COMPILE_FLAGS if large_model else COMPILE_FLAGS
    return {**os.environ, "XLA_FLAGS": flags, **overrides}
