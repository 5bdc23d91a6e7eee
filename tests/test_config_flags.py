"""The command line's flags come from the configs' fields: every field has one, and they read back into configs."""

import dataclasses

import pytest
from absl import flags

from paxkv.config import EngineConfig, LoadConfig, SpeculativeConfig
from paxkv.entrypoints.config_flags import config_from_flags, define_flags, format_memory_size


def _flags(*argv) -> flags.FlagValues:
    values = flags.FlagValues()
    define_flags(EngineConfig, values)
    define_flags(LoadConfig, values)
    values(["paxkv", *argv])
    return values


def _leaf_fields(config_class):
    """The fields that are flags: a nested config's (EngineConfig.speculative_config) stand for it."""
    for field in dataclasses.fields(config_class):
        if field.metadata.get("nested"):
            yield from _leaf_fields(field.metadata["nested"])
        else:
            yield field


def test_every_field_is_a_flag_with_its_default_and_help():
    values = _flags()
    for config_class in (EngineConfig, LoadConfig):
        for field in _leaf_fields(config_class):
            name = field.metadata.get("flag") or field.name
            assert values[name].help.endswith(field.metadata["help"]), name  # enums prefix their choices
        assert config_from_flags(config_class, values) == config_class()  # the defaults round-trip


def test_flags_read_back_into_the_configs():
    values = _flags(
        "--page_size=8",
        "--kv_cache_memory=2GiB",
        "--no_prefix_caching",
        "--swap_space=0",
        "--mesh=data=1,model=2",
        "--kv_cache_dtype=int8",
        "--engine_seed=3",
        "--dtype=bfloat16",
        "--attention_impl=xla",
    )
    assert config_from_flags(EngineConfig, values) == EngineConfig(
        page_size=8,
        kv_cache_memory_bytes=2 * 2**30,
        enable_prefix_caching=False,
        swap_space_bytes=0,
        mesh_shape="data=1,model=2",
        kv_cache_dtype="int8",
        seed=3,
    )
    assert config_from_flags(LoadConfig, values) == LoadConfig(dtype="bfloat16", attention_impl="xla")


def test_speculative_flags_make_the_nested_config():
    values = _flags("--speculative_method=ngram", "--num_speculative_tokens=3", "--prompt_lookup_max=2")
    config = config_from_flags(EngineConfig, values)
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    assert config_from_flags(EngineConfig, _flags()).speculative_config is None  # method none: no speculation
    values = _flags("--speculative_method=draft_model", "--speculative_model=/models/draft")
    assert config_from_flags(EngineConfig, values).speculative_config == SpeculativeConfig(
        method="draft_model", model="/models/draft"
    )
    with pytest.raises(ValueError, match="'draft_model' needs the draft's checkpoint"):
        config_from_flags(EngineConfig, _flags("--speculative_method=draft_model"))
    with pytest.raises(ValueError, match="prompt_lookup_min=3 exceeds prompt_lookup_max=2"):
        config_from_flags(
            EngineConfig, _flags("--speculative_method=ngram", "--prompt_lookup_min=3", "--prompt_lookup_max=2")
        )


def test_bad_flag_values_name_the_flag_and_the_fix():
    with pytest.raises(ValueError, match="--kv_cache_memory: cannot read 'lots' as a memory size; write e.g."):
        config_from_flags(EngineConfig, _flags("--kv_cache_memory=lots"))
    with pytest.raises(ValueError, match="watermark is the fraction of pages admission keeps free"):
        config_from_flags(EngineConfig, _flags("--watermark=1.5"))
    with pytest.raises(flags.IllegalFlagValueError):
        _flags("--preemption_mode=sometimes")  # enums come from the field's choices


def test_memory_sizes_print_as_the_shortest_exact_unit():
    assert [format_memory_size(n) for n in (2**30, 512 * 2**20, 1000, 3 * 2**10)] == ["1GiB", "512MiB", "1000", "3KiB"]
