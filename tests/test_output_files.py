"""The runner's files: writability checked up front, atomic final files, the journal, and --resume's split."""

import errno
import json
import os

import pytest

from paxkv.entrypoints.output_files import (
    Journal,
    check_writable,
    journal_path,
    read_records,
    request_hash,
    write_atomically,
)
from paxkv.entrypoints.prompts_file import BadLine, parse_lines
from paxkv.entrypoints.resume import finished_records, merge, split_done


def test_check_writable_names_the_flag_and_the_fix(tmp_path, monkeypatch):
    check_writable(str(tmp_path / "out.jsonl"), "--output")  # a new file in a writable folder
    with pytest.raises(ValueError, match=r"^--output .* is a folder; give a file path, e\.g\. .*results\.jsonl$"):
        check_writable(str(tmp_path), "--output")
    missing = tmp_path / "nope" / "m.json"
    with pytest.raises(ValueError, match=r"--metrics_json .*m\.json: the folder .*nope does not exist; create it"):
        check_writable(str(missing), "--metrics_json")

    def read_only(**kwargs):  # what a read-only mount answers (tests here run as root, whom chmod never stops)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("paxkv.entrypoints.output_files.tempfile.NamedTemporaryFile", read_only)
    with pytest.raises(ValueError, match=r"cannot write in .* \(Read-only file system\); choose another path"):
        check_writable(str(tmp_path / "out.jsonl"), "--output")
    monkeypatch.undo()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".paxkv-write-check")]  # the probe is gone


def test_write_atomically_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    write_atomically(str(path), "new ünïcode\n")
    assert path.read_text(encoding="utf-8") == "new ünïcode\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_journal_survives_a_torn_last_line_and_appends_after_it(tmp_path):
    path = journal_path(str(tmp_path / "out.jsonl"))
    journal = Journal(path, keep_existing=False)
    journal.append({"id": "a", "finish_reason": "length"})
    journal.close()
    with open(path, "a") as f:
        f.write('{"id": "b", "finish_re')  # a run killed mid-write
    assert read_records(path) == [{"id": "a", "finish_reason": "length"}]
    journal = Journal(path, keep_existing=True)
    journal.append({"id": "c", "finish_reason": "stop"})
    journal.close()
    assert [r["id"] for r in read_records(path)] == ["a", "c"]  # the torn line is skipped, not glued on
    Journal(path, keep_existing=False).remove()  # a fresh run starts it empty
    assert not os.path.exists(path)


def test_read_records_refuses_a_file_paxkv_did_not_write(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match=r"other\.jsonl:1: not a JSON line; this is not a paxkv output or journal"):
        read_records(str(path))


def _lines(tmp_path, texts):
    return parse_lines([json.dumps(t) for t in texts], {"max_tokens": 4}, "p.jsonl")


def test_resume_keeps_unchanged_finished_lines_and_reruns_the_rest(tmp_path):
    lines = _lines(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "c", "prompt": "z"}])
    output = tmp_path / "out.jsonl"
    done_a = {"id": "a", "line": 1, "input_hash": lines[0].input_hash, "finish_reason": "length", "token_ids": [1]}
    aborted_b = {"id": "b", "line": 2, "input_hash": lines[1].input_hash, "finish_reason": "abort", "token_ids": []}
    output.write_text(json.dumps(done_a) + "\n" + json.dumps(aborted_b) + "\n")
    journal = Journal(journal_path(str(output)), keep_existing=False)
    journal.append({"id": "c", "line": 3, "input_hash": lines[2].input_hash, "finish_reason": "stop"})
    journal.close()
    to_run, done = split_done(lines, finished_records(str(output)))
    assert [line.request_id for line in to_run] == ["b"] and sorted(done) == [0, 2]
    merged = merge(lines, to_run, [{"id": "b", "finish_reason": "length"}], done)
    assert [r["id"] for r in merged] == ["a", "b", "c"]


def test_resume_names_every_changed_line(tmp_path):
    before = _lines(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y", "temperature": 0}])
    finished = {
        line.request_id: {"id": line.request_id, "input_hash": line.input_hash, "finish_reason": "length"}
        for line in before
    }
    after = _lines(tmp_path, [{"id": "a", "prompt": "x!"}, {"id": "b", "prompt": "y", "temperature": 0.5}])
    with pytest.raises(ValueError, match=r"line 1 \(id 'a'\), line 2 \(id 'b'\) changed since the earlier run"):
        split_done(after, finished)
    assert split_done(before, finished)[0] == []  # nothing changed: nothing to run
    with pytest.raises(ValueError, match=r"neither .*missing\.jsonl nor .*missing\.jsonl\.journal exists"):
        finished_records(str(tmp_path / "missing.jsonl"))


def test_bad_lines_always_rerun_and_hashes_cover_the_sampling_fields(tmp_path):
    lines = _lines(tmp_path, [{"id": "a", "prompt": "x"}])
    bad = BadLine(2, "line-2", "p.jsonl:2: not valid JSON")
    to_run, done = split_done([*lines, bad], {"line-2": {"id": "line-2", "finish_reason": "length"}})
    assert to_run == [*lines, bad] and list(done) == []  # a bad line never counts as done
    base = request_hash("x", None, None, {"temperature": 1.0})
    assert base == request_hash("x", None, None, {"temperature": 1.0})
    assert base != request_hash("x", None, None, {"temperature": 0.0})
    assert base != request_hash("x", None, "salt", {"temperature": 1.0})
