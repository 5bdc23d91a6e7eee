"""The persistent compilation cache: a second process running the same model compiles nothing."""

import json
import os
import subprocess
import sys
import textwrap

from subprocess_env import subprocess_env

_CHILD = textwrap.dedent(
    """
    import json, os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from flax import nnx
    from models import Llama, ModelConfig, PagedSequence
    from paxkv.entrypoints.compilation_cache import enable_compilation_cache

    events = {"hits": 0, "misses": 0}
    def listen(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            events["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            events["misses"] += 1
    jax.monitoring.register_event_listener(listen)
    enable_compilation_cache()
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    graphdef, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    sequence = PagedSequence(graphdef, state, config, max_tokens=24, page_size=8)
    sequence.feed(list(range(10)))
    sequence.feed([3])
    print(json.dumps(events))
    """
)


def _run_child(cache_dir: str) -> dict:
    env = subprocess_env(PAXKV_COMPILATION_CACHE_DIR=cache_dir, PAXKV_COMPILATION_CACHE_MIN_SECONDS="0")
    result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_second_run_compiles_nothing(tmp_path):
    cache_dir = str(tmp_path / "cache")
    first = _run_child(cache_dir)
    assert first["misses"] > 0  # the first run compiled and filled the cache
    assert os.listdir(cache_dir)
    second = _run_child(cache_dir)
    assert second["misses"] == 0, second
    assert second["hits"] >= first["misses"]
