#!/usr/bin/env bash
# One prepared run for an accelerator machine: the kernel tests' cases natively, the kernel benchmark, then the
# engine end to end (scripts/device_engine_check.py).
#
#   scripts/device_check.sh [OUT_DIR]      (OUT_DIR defaults to $OUT, else bench_results)
#
# The kernel parts need only python3 with jax (and its CUDA or TPU plugin) and numpy: no network, no pip, no
# pytest; the engine part needs flax, torch and transformers too.
# On a machine without an accelerator it runs the benchmark's XLA-path part on a small preset.
# Writes OUT_DIR/native_checks.txt, kernels.json, kernels.md, engine_check.txt and engine_check_*.json.
# Budget: the checks are cut at 4 minutes, the benchmark at 2.5 and the engine at 3, so the whole run fits in 10
# (on an H200, 2026-12-04: checks 2.4 minutes, benchmark about 1).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-bench_results}}"
python="${PYTHON:-python3}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$python" -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
backend="$("$python" -c 'import jax; print(jax.default_backend())')"
status=0
if [ "$backend" = "cpu" ]; then
  echo "no accelerator: skipping the native kernel checks; benchmarking the XLA path on the small preset"
  "$python" scripts/bench_kernels.py --impls xla --preset small --out "$out_dir/kernels" ${BENCH_ARGS:-} || status=1
else
  timeout 240 "$python" scripts/check_kernels_native.py 2>&1 | tee "$out_dir/native_checks.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  timeout 150 "$python" scripts/bench_kernels.py --out "$out_dir/kernels" ${BENCH_ARGS:-} || status=1
  # The engine end to end (needs flax, torch and transformers, as CUDA images hold them): greedy against XLA.
  timeout 180 "$python" scripts/device_engine_check.py --out "$out_dir" --throughput_kv bfloat16 2>&1 \
    | tee "$out_dir/engine_check.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "device_check exit status: $status"
exit $status
