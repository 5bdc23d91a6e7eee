"""JSONL prompt lines and memory sizes: what parses, and the errors (with line numbers) for what does not."""

import json

import pytest

from paxkv.entrypoints.config_flags import parse_memory_size
from paxkv.entrypoints.prompts_file import BadLine, PromptLine, decode_file, parse_line, parse_lines


def test_a_line_takes_the_flags_as_defaults_and_overrides_them():
    line = parse_line('{"prompt": "hi", "temperature": 0.5, "id": 7}', 3, {"max_tokens": 9, "temperature": 0})
    assert line == PromptLine(3, "7", "hi", None, line.sampling_params)
    assert line.sampling_params.temperature == 0.5 and line.sampling_params.max_tokens == 9


def test_token_ids_and_messages_are_accepted():
    ids = parse_line('{"prompt": [1, 2, 3]}', 1, {})
    assert ids.prompt == [1, 2, 3] and ids.request_id == "line-1"
    chat = parse_line(json.dumps({"messages": [{"role": "user", "content": "hey"}]}), 2, {})
    assert chat.messages == [{"role": "user", "content": "hey"}] and chat.prompt is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("{oops", r"not valid JSON \(.* at column 2\)"),
        ("[1, 2]", "a line must be a JSON object, got list"),
        ('{"prompt": "x", "temprature": 1}', r"unknown field\(s\) \['temprature'\].*sampling fields"),
        ('{"id": "a"}', 'exactly one of "prompt" or "messages"'),
        ('{"prompt": "x", "messages": []}', 'exactly one of "prompt" or "messages"'),
        ('{"prompt": 5}', '"prompt" must be a string or a list of integer token ids'),
        ('{"prompt": [1, true]}', '"prompt" must be a string or a list of integer token ids'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', r'"messages"\[0\] must have a string "content"'),
        ('{"prompt": "x", "temperature": -1}', "temperature must be >= 0"),
        ('{"prompt": "x", "top_p": 0}', r"top_p must be in \(0, 1\]"),
        ('{"prompt": "x", "top_k": -2}', "top_k must be -1 or 0"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1"),
    ],
)
def test_bad_lines_name_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        parse_line(text, 1, {})


def test_parse_lines_numbers_errors_skips_blanks_and_refuses_duplicate_ids():
    text = ['{"prompt": "a", "id": "x"}', "", "nope", '{"prompt": "b", "id": "x"}', '{"prompt": "c"}']
    parsed = parse_lines(text, {}, "in.jsonl")
    assert [type(p) for p in parsed] == [PromptLine, BadLine, BadLine, PromptLine]
    assert parsed[1].error.startswith("in.jsonl:3: not valid JSON") and parsed[1].line_number == 3
    assert parsed[2].error == "in.jsonl:4: id 'x' appears twice; give each line a unique id"
    assert parsed[3].request_id == "line-5"


@pytest.mark.parametrize(
    "text, size", [("1000", 1000), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000), ("4kb", 4000)]
)
def test_memory_sizes(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "2 XB", "-1GiB", "0"])
def test_bad_memory_sizes(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(text)


def test_a_bom_is_dropped_and_bytes_that_are_not_utf8_fail_their_line_alone():
    bom, utf8_line, latin1_line = (
        b"\xef\xbb\xbf",
        b'{"id": "first", "prompt": "caf\xc3\xa9"}',
        b'{"id": "latin1", "prompt": "caf\xe9"}',
    )
    data = bom + utf8_line + b"\n" + latin1_line + b'\n{"prompt": "ok"}\n'
    lines = parse_lines(decode_file(data).splitlines(), {}, "p.jsonl")
    assert isinstance(lines[0], PromptLine) and lines[0].prompt == "café"
    assert lines[1] == BadLine(  # the line's own id, even so
        2, "latin1", "p.jsonl:2: not UTF-8 text (byte 0xe9 at column 32); save the file as UTF-8"
    )
    assert isinstance(lines[2], PromptLine)


def test_bad_lines_keep_their_own_id():
    lines = parse_lines(['{"id": "q7", "prompt": "x", "bogus": 1}', '{"id": 12, "temperature": -1}', "[1]"], {}, "p")
    assert [line.request_id for line in lines] == ["q7", "12", "line-3"]
    assert all(isinstance(line, BadLine) for line in lines)
