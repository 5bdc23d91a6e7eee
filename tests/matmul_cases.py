"""Shared by the native matmuls' tests: random operands and the exact product with its f32 error bound."""

import jax.numpy as jnp
import numpy as np


def random_case(seed, rows, depth, columns, dtype, contraction_last):
    """x f32[rows, depth] and a weight of `dtype`, [columns, depth] with contraction_last, else [depth, columns]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    weight = rng.standard_normal((columns, depth) if contraction_last else (depth, columns)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(weight, dtype)


def exact_product(x, weight, contraction_last):
    """x (rounded to the weight's dtype, as the kernels' contract says) @ weight in float64, and the float32
    summation error bound depth * eps * (|x| @ |weight|) that any order of f32 sums stays within."""
    rounded = np.asarray(x.astype(weight.dtype).astype(jnp.float32), np.float64)
    wide = np.asarray(weight.astype(jnp.float32), np.float64)
    wide = wide.T if contraction_last else wide
    bound = x.shape[1] * np.finfo(np.float32).eps * (np.abs(rounded) @ np.abs(wide))
    return rounded @ wide, bound


def check_within_summation_error(
    matmul, reference, shapes, row_counts, dtype, contraction_last, seed_stride, takes=lambda depth, columns: True
):
    """Every (shape, row count) the kernel `takes`: matmul's product has the right shape and lies within
    exact_product's f32 bound, as does the jnp reference (the contract they share). The case of shape i and r rows
    is seeded i * seed_stride + r."""
    for index, (depth, columns) in enumerate(shapes):
        if not takes(depth, columns):
            continue
        for rows in row_counts:
            x, weight = random_case(index * seed_stride + rows, rows, depth, columns, dtype, contraction_last)
            out = np.asarray(matmul(x, weight, contraction_last=contraction_last))
            exact, bound = exact_product(x, weight, contraction_last)
            assert out.shape == (rows, columns)
            assert np.all(np.abs(out - exact) <= bound), (depth, columns, rows)
        expected = np.asarray(reference(x, weight, contraction_last=contraction_last))
        assert np.all(np.abs(expected - exact) <= bound)
