#!/usr/bin/env bash
# Start N paxkv processes on this machine, joined into one multi-process run over 127.0.0.1: a local
# stand-in for N hosts, for testing. Each process gets PAXKV_LOCAL_DEVICES (default 2) fake CPU devices.
#
#   scripts/launch_multihost.sh N [paxkv flags...]
#   scripts/launch_multihost.sh 2 --prompts_file prompts.jsonl --output out.jsonl --mesh data=1,model=4
#
# Process 0 hosts the coordinator, reads the requests and writes the outputs; the others compute alongside.
# Their stderr goes to ${PAXKV_LOG_DIR:-a temporary folder}/process-<i>.log. Exits non-zero if any process fails.
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES [paxkv flags...]" >&2
  exit 2
fi
num_processes=$1
shift
python=${PYTHON:-python}
devices=${PAXKV_LOCAL_DEVICES:-2}
log_dir=${PAXKV_LOG_DIR:-$(mktemp -d)}
mkdir -p "$log_dir"
port=${PAXKV_COORDINATOR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

pids=()
for ((i = 0; i < num_processes; i++)); do
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=$devices XLA_FLAGS= \
    "$python" -m paxkv.entrypoints.run --coordinator_address="127.0.0.1:$port" --num_processes="$num_processes" \
    --process_id="$i" "$@" 2>"$log_dir/process-$i.log" &
  pids+=($!)
done

status=0
for ((i = 0; i < num_processes; i++)); do
  if ! wait "${pids[$i]}"; then
    echo "process $i failed; its log ($log_dir/process-$i.log) ends:" >&2
    tail -n 20 "$log_dir/process-$i.log" >&2
    status=1
  fi
done
if [[ $status -eq 0 ]]; then
  cat "$log_dir/process-0.log" >&2
fi
exit $status
