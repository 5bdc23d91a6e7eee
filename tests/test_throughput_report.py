"""scripts/throughput_report.py: the throughput benchmark's derived ratios, roofline shares and markdown table."""

import os

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def test_throughput_report_gives_bf16_its_own_ratio_column(monkeypatch):
    """paxkv_bf16 rows get their own ratio over each peer, and the table says they are not an equal-precision peer."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import throughput_report

    def row(system, tokens_per_s):
        return dict(system=system, model="smollm2", batch=32, tokens_per_s=tokens_per_s, ttft_s=1.0, peak_rss_mib=1.0)

    result = dict(
        settings=dict(systems=["paxkv", "paxkv_bf16", "vllm"], prompt_len=128, new_tokens=128, repeats=1, threads=2),
        machine="test",
        roofline_gflops=100.0,
        paxkv_commit="abc",
        params={"smollm2": 1e8},
        rows=[row("paxkv", 150.0), row("paxkv_bf16", 225.0), row("vllm", 300.0)],
        ratios=[],
        first_tokens_match={"smollm2": {"32": True}},
        tokens_identical_to_paxkv={"smollm2": {"32": {"paxkv_bf16": False, "vllm": True}}},
        errors=[],
    )
    throughput_report.add_derived(result)
    vllm = result["rows"][2]
    assert vllm["paxkv_over_this"] == pytest.approx(0.5) and vllm["paxkv_bf16_over_this"] == pytest.approx(0.75)
    assert "paxkv_bf16_over_this" not in result["rows"][0]  # no ratio of one paxkv over another
    assert {r["ratio"] for r in result["ratios"]} == {"paxkv/paxkv_bf16", "paxkv/vllm", "paxkv_bf16/vllm"}
    table = throughput_report.markdown(result)
    assert "| paxkv_bf16 ÷ system |" in table and "| smollm2 | 32 | vllm | 300.0 | 0.50 | 0.75 |" in table
    assert "not an equal-precision peer" in table


def test_throughput_report_counts_int8_scales_and_mins_in_the_decode_share(monkeypatch):
    """An int8 weight reads a byte plus its group's f32 scale and min (8 bytes per 32 weights): 1.25 bytes."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import throughput_report

    row = dict(system="paxkv_int8", model="smollm2", batch=2, prompt_len=100, new_tokens=100, decode_ms_per_step=20.0)
    result = dict(roofline_gflops=100.0, read_bandwidth_gbs=10.0)
    # 1e8 weights x 1.25 bytes + 2 x 150 x 1000 KV bytes at 1e10 B/s: 12.53 ms (above 4 ms of FLOPs) over 20 ms.
    shares = throughput_report.roofline_shares(row, 1e8, 1000, result)
    assert shares["decode_roofline_share"] == pytest.approx(0.6265)


def test_throughput_report_shares_llamacpp_row_and_skipped_models(monkeypatch):
    """Roofline shares follow their definition (a prompt token multiplies the layers' weights, a generated one the
    lm_head's too); llama.cpp rows get a ratio but no share, and say what they are; a model llama.cpp cannot run
    is listed as skipped."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import throughput_report

    def row(system, tokens_per_s, decode_ms):
        return dict(
            system=system,
            model="smollm2",
            batch=2,
            prompt_len=100,
            new_tokens=100,
            tokens_per_s=tokens_per_s,
            ttft_s=1.0,
            peak_rss_mib=1.0,
            prefill_tokens_per_s=200.0,
            decode_ms_per_step=decode_ms,
        )

    result = dict(
        settings=dict(systems=["paxkv", "llamacpp"], prompt_len=100, new_tokens=100, repeats=1, threads=2),
        machine="test",
        roofline_gflops=100.0,
        read_bandwidth_gbs=10.0,
        kv_bytes_per_token={"smollm2": 1000},
        model_shape={"smollm2": {"embedding_params": 2 * 10**7, "tied_embeddings": True}},
        paxkv_commit="abc",
        params={"smollm2": 1e8},
        rows=[row("paxkv", 50.0, 100.0), row("llamacpp", 100.0, 20.0)],
        ratios=[],
        first_tokens_match={"smollm2": {"2": None}},
        tokens_identical_to_paxkv={},
        skipped=[{"system": "llamacpp", "model": "random_llama", "reason": "no GGUF"}],
        errors=[],
    )
    throughput_report.add_derived(result)
    paxkv, llamacpp = result["rows"]
    # 1e8 parameters, 2e7 of them the tied embedding: a prompt token multiplies 8e7 weights, a generated one 1e8.
    # Prefill: 1.6e8 FLOPs a token x 200 tok/s over 1e11 FLOP/s. Decode: 4e8 weight bytes + 2 x 150 x 1000 KV bytes
    # at 1e10 B/s (40.03 ms, above the 4 ms of FLOPs), over the 100 ms step.
    assert paxkv["prefill_roofline_share"] == pytest.approx(0.32)
    assert paxkv["decode_roofline_share"] == pytest.approx(0.4003)
    assert "decode_roofline_share" not in llamacpp and llamacpp["paxkv_over_this"] == pytest.approx(0.5)
    table = throughput_report.markdown(result)
    assert "| smollm2 | 2 | paxkv | 50.0 | — | 1.000 | 200 | 100.0 | 32% / 40% |" in table
    assert "| smollm2 | 2 | llamacpp | 100.0 | 0.50 | 1.000 | 200 | 20.0 | — / — |" in table
    assert "not an equal-precision peer" in table and "llamacpp/random_llama skipped: no GGUF." in table


def test_throughput_report_takes_the_model_facts_from_any_paxkv_system(monkeypatch):
    """A run without paxkv itself still gets the model's shape and f32 KV bytes (a bf16 pool's doubled), so its
    prefill share leaves out the embedding; paxkv's own pool wins over the others'."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import throughput_report

    shape = {"embedding_params": 20_000_000, "tied_embeddings": True}
    result = dict(model_shape={}, kv_bytes_per_token={})

    def record(system, kv_bytes_per_token):
        ready = {"kv_bytes_per_token": kv_bytes_per_token, "shape": shape}
        throughput_report.record_model_facts(result, "smollm2", system, ready)

    record("vllm_bf16", 9)
    assert result == dict(model_shape={}, kv_bytes_per_token={})
    # An int8 pool's bytes (values and scales) are no constant share of f32's: they stay its own.
    record("paxkv_bf16_int8_kv", 264)
    assert result["kv_bytes_per_token"] == {} and result["model_shape"] == {"smollm2": shape}
    record("paxkv_bf16_kv", 500)
    assert result["kv_bytes_per_token"] == {"smollm2": 1000}
    assert result["pool_bytes_per_token"] == {"smollm2": {"paxkv_bf16_int8_kv": 264, "paxkv_bf16_kv": 500}}
    record("paxkv", 1004)
    assert result["kv_bytes_per_token"] == {"smollm2": 1004}
    record("paxkv_int8", 7)
    assert result["kv_bytes_per_token"] == {"smollm2": 1004}
    # 1000 prompt tokens/s x 2 x (1e8 - 2e7) layer weights at 200 GFLOP/s (bf16): 0.8
    row = dict(system="paxkv_bf16_kv", model="smollm2", prefill_tokens_per_s=1000.0)
    ceilings = dict(roofline_gflops=100.0, roofline_gflops_bf16=200.0, model_shape=result["model_shape"])
    assert throughput_report.roofline_shares(row, 1e8, None, ceilings)["prefill_roofline_share"] == pytest.approx(0.8)
    # The int8 pool's decode share: 2e8 bytes of bf16 weights + 2 x 150 x 264 of its own KV at 10 GB/s (20.008 ms,
    # above 2 ms of FLOPs), over its 100 ms step; paxkv's f32 KV bytes do not enter.
    row = dict(system="paxkv_bf16_int8_kv", model="smollm2", batch=2, prompt_len=100, new_tokens=100)
    row["decode_ms_per_step"] = 100.0
    ceilings.update(read_bandwidth_gbs=10.0, pool_bytes_per_token=result["pool_bytes_per_token"])
    shares = throughput_report.roofline_shares(row, 1e8, 1004, ceilings)
    assert shares["decode_roofline_share"] == pytest.approx(0.200079)
