"""SamplingParams: vLLM defaults, validation messages, normalization and from_dict."""

import dataclasses

import pytest

from paxkv.scheduling.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (None, 16, 0, False, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, r"temperature must be >= 0 .*got -0.1"),
        ({"temperature": float("nan")}, r"temperature must be finite"),
        ({"temperature": "hot"}, r"temperature must be a number, got 'hot'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\].*got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\].*got 1.5"),
        ({"top_k": -2}, r"top_k must be -1 or 0 \(disabled\) or a positive integer, got -2"),
        ({"top_k": 2.5}, r"top_k must be an integer, got 2.5"),
        ({"min_p": -0.01}, r"min_p must be in \[0, 1\].*got -0.01"),
        ({"min_p": 1.01}, r"min_p must be in \[0, 1\].*got 1.01"),
        ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
        ({"max_tokens": -3}, r"max_tokens must be at least 1, got -3"),
        ({"min_tokens": -1}, r"min_tokens must be >= 0, got -1"),
        ({"min_tokens": 17}, r"min_tokens must be <= max_tokens \(16\), got 17"),
        ({"n": 0}, r"n must be at least 1, got 0"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 .*got 0.0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be > 0 .*got -1.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\].*got 2.5"),
        ({"presence_penalty": -2.01}, r"presence_penalty must be in \[-2.0, 2.0\].*got -2.01"),
        ({"frequency_penalty": 3.0}, r"frequency_penalty must be in \[-2.0, 2.0\].*got 3.0"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2.0, 2.0\].*got -3.0"),
        ({"logprobs": -1}, r"logprobs must be None or in \[0, 20\].*got -1"),
        ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\].*got 21"),
        ({"stop": ["ok", 3]}, r"stop must hold only strings, got 3 \(int\)"),
        ({"stop": 7}, r"stop must be a string or a list of strings, got 7"),
        ({"stop": [""]}, r"stop strings must be non-empty"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids must be token ids >= 0, got -2"),
        ({"stop_token_ids": [1, "2"]}, r"stop_token_ids entry must be an integer, got '2'"),
        ({"stop_token_ids": 5}, r"stop_token_ids must be a list of token ids, got 5"),
        ({"seed": 1.5}, r"seed must be an integer, got 1.5"),
        ({"seed": True}, r"seed must be an integer, got True"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be a bool, got 'yes'"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, max_tokens=1, min_tokens=1, logprobs=0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3, top_p=1e-6, min_p=0.0)


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_normalization():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[2, 7]).stop_token_ids == (2, 7)
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))  # tuples keep the frozen params hashable


def test_greedy_and_frozen():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0).temperature == 0.0 and isinstance(
        SamplingParams(temperature=0).temperature, float
    )
    assert not SamplingParams(temperature=0.7).greedy
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)  # replace re-validates


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": -1, "stop": "END", "seed": 3, "max_tokens": 8})
    assert p == SamplingParams(temperature=0.5, top_k=0, stop=("END",), seed=3, max_tokens=8)
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_unknown_field():
    with pytest.raises(ValueError, match=r"unknown sampling field\(s\) 'temprature'; valid: n, temperature, top_p"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match=r"'beam', 'best_of'"):
        SamplingParams.from_dict({"beam": 1, "best_of": 2, "top_k": 3})


def test_from_dict_invalid_value_and_type():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="must be a mapping"):
        SamplingParams.from_dict([("top_p", 0.5)])  # type: ignore[arg-type]
