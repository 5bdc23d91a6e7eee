"""The kernel tests' cases run natively (not interpreted) on a GPU or TPU, against the XLA reference.

    python scripts/check_kernels_native.py [--backend_kernel gpu|tpu]

The same random cases as tests/test_attention_kernels.py (tests/kernel_cases.py), with the same
per-dtype tolerances, plus block-size, sliding-window / soft-cap, group-of-3 and bf16-query
variants. Needs only jax and numpy (no pytest), so it runs on a bare accelerator image. Prints
one line per case and exits nonzero if any case fails.
"""

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from kernel_cases import CASES, RELATIVE_TOLERANCE, relative_error, standard_case  # noqa: E402

from pallas_kernels import (  # noqa: E402
    paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
)


def _all_cases():
    """(name, case, kv dtype, kernel options, reference options) for every check."""
    for seed, (kv_dtype, kind, page_size, head_dim, group) in enumerate(CASES):
        name = f"{kv_dtype} {kind} page={page_size} head_dim={head_dim} gqa={group}"
        yield name, standard_case(seed, kv_dtype, kind, page_size, head_dim, group), kv_dtype, {}, {}
    for queries_per_block, pages_per_block in [(1, 1), (2, 4), (8, 2), (32, 1)]:
        options = dict(queries_per_block=queries_per_block, pages_per_block=pages_per_block)
        yield f"blocks {options}", standard_case(3, "float32", "mixed", 8, 64, 2), "float32", options, {}
    for sliding_window, soft_cap in [(5, None), (None, 2.0), (20, 5.0)]:
        options = dict(sliding_window=sliding_window, soft_cap=soft_cap)
        case = standard_case(4, "float32", "mixed", 8, 64, 2)
        yield f"window/cap {options}", case, "float32", {**options, "pages_per_block": 1}, options
    yield "gqa=3 (9 over 3 heads)", standard_case(5, "bfloat16", "mixed", 16, 64, 3, num_kv_heads=3), "bfloat16", {}, {}
    case = standard_case(6, "bfloat16", "mixed", 16, 128, 4, q_dtype=jnp.bfloat16)
    yield "bf16 queries", case, "bfloat16", {}, {}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "tpu" if jax.default_backend() == "tpu" else "gpu"
    parser.add_argument("--backend_kernel", choices=["gpu", "tpu"], default=default)
    parser.add_argument("--interpret", action="store_true", help="interpret the kernel instead (a CPU smoke run)")
    args = parser.parse_args()
    # The reference's f32 matmuls must not drop to TF32 on a GPU: the f32 tolerance is 1e-5.
    jax.config.update("jax_default_matmul_precision", "highest")
    kernel = paged_attention_gpu if args.backend_kernel == "gpu" else ragged_paged_attention_tpu
    mode = "interpreted" if args.interpret else "native"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; kernel: {args.backend_kernel}, {mode}")
    failures = 0
    for name, case, kv_dtype, options, reference_options in _all_cases():
        start = time.perf_counter()
        try:
            out = kernel(
                case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, interpret=args.interpret, **options
            )
            ref = ragged_paged_attention_reference(
                case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, **reference_options
            )
            out = np.asarray(jax.device_get(out), np.float32)
            error = relative_error(out, ref, case.num_live_tokens)
            finite = bool(np.isfinite(out[: case.num_live_tokens]).all())
            ok = finite and error <= RELATIVE_TOLERANCE[kv_dtype]
            detail = f"rel err {error:.2e} (tol {RELATIVE_TOLERANCE[kv_dtype]:.0e}){'' if finite else ' NON-FINITE'}"
        except Exception:  # report every case, not just the first failure
            ok, detail = False, "raised:\n" + traceback.format_exc(limit=4)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail} [{time.perf_counter() - start:.1f}s]", flush=True)
    print(f"{failures} failed" if failures else "all native kernel checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
