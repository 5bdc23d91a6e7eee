"""Orbax restore across two processes: each reads, and holds, only its own half of the model."""

import json
import os
import socket
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

import models
from models.orbax_checkpoint import save_orbax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Restores the checkpoint (onto a data=1,model=4 mesh when the run has two processes, else one device) and
# prints how many bytes it read from files, how far its peak RSS grew, and what it holds.
RESTORE = """
import json, sys
from paxkv.parallel import distributed
directory, port, process_id = sys.argv[1], sys.argv[2], int(sys.argv[3])
if process_id >= 0:
    distributed.initialize(f"127.0.0.1:{port}", 2, process_id, timeout_seconds=60)
import models, orbax.checkpoint, tensorstore  # imported before the baseline
from flax import nnx
from paxkv.parallel.mesh import make_mesh

def bytes_read():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])

def peak_rss():  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS when it forked
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024

read_before, peak_before = bytes_read(), peak_rss()
mesh = make_mesh("data=1,model=4") if process_id >= 0 else None
loaded = models.load(directory, mesh=mesh, require_tokenizer=False)
report = {
    "read": bytes_read() - read_before,
    "peak_growth": peak_rss() - peak_before,
    "model_bytes": 0,
    "local_bytes": 0,
    "specs": {},
}
for path, variable in nnx.to_flat_state(loaded.state):
    array = variable.get_value()
    report["model_bytes"] += array.nbytes
    report["local_bytes"] += sum(shard.data.nbytes for shard in array.addressable_shards)
    report["specs"]["/".join(map(str, path))] = str(tuple(array.sharding.spec)) if mesh else None
print("RESULT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, make_tiny_llama):
    """An orbax checkpoint of a ~330 MB f32 Llama, most of it a 48,000-word vocabulary split on model."""
    folder = tmp_path_factory.mktemp("big_orbax")
    make_tiny_llama(
        hidden_size=768, num_attention_heads=8, num_key_value_heads=4, intermediate_size=2048, vocab_size=48000
    ).save_pretrained(folder / "hf")
    save_orbax(models.load(folder / "hf", require_tokenizer=False), str(folder / "orbax"))
    return folder / "orbax"


def _env() -> dict:
    return subprocess_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", PYTHONPATH=ROOT)


def _report(output: str) -> dict:
    # Gloo writes its own lines to stdout, at times with no newline between: decode just the object.
    return json.JSONDecoder().raw_decode(output[output.index("RESULT ") + len("RESULT ") :])[0]


def test_two_processes_each_read_and_hold_half_the_model(checkpoint, tmp_path):
    script = tmp_path / "restore.py"
    script.write_text(RESTORE)
    single = subprocess.run(
        [sys.executable, str(script), str(checkpoint), "0", "-1"], env=_env(), capture_output=True, text=True
    )
    assert single.returncode == 0, single.stderr[-2000:]
    alone = _report(single.stdout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(checkpoint), str(port), str(i)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-2000:]
    model_bytes = alone["model_bytes"]
    assert alone["read"] > 0.8 * model_bytes  # one process alone reads the whole model
    for stdout, _ in outputs:
        report = _report(stdout)
        read, peak = report["read"] / alone["read"], report["peak_growth"] / alone["peak_growth"]
        print(f"one of two processes: read {read:.2f}, peak RSS growth {peak:.2f} of one process's")
        assert report["model_bytes"] == model_bytes
        # Everything but the norms is split over model=4; each process has two of the four devices.
        assert abs(report["local_bytes"] - model_bytes / 2) < 0.01 * model_bytes
        assert report["specs"]["embed"] == "('model', None)" and report["specs"]["lm_head"] == "(None, 'model')"
        assert report["specs"]["layers/0/mlp/down"] == "('model', None)"
        # Each reads from the files only the chunks its shards cover (measured: 0.52 of the whole)...
        assert report["read"] < 0.6 * alone["read"], (report["read"], alone["read"])
        # ...and its peak RSS grows by about half as much as one process's restoring it all (measured 0.45 to
        # 0.64; on CPU a device buffer is host memory, and each shard is briefly held twice while it is placed).
        assert report["peak_growth"] < 0.75 * alone["peak_growth"], (report["peak_growth"], alone["peak_growth"])
