"""--resume: rerun a prompts file against an earlier run's output and journal, running only what is left.

A line is done when an earlier record with its id finished (not an error, not aborted) and carries the same
input hash: the same prompt or messages, cache salt and sampling fields, flags included. A done line whose
content changed is an error, since its old result would no longer answer it. Everything else runs again.
"""

import os

from paxkv.entrypoints.output_files import journal_path, read_records
from paxkv.entrypoints.prompts_file import BadLine, PromptLine


def finished_records(output: str) -> dict[str, dict]:
    """The finished records of an earlier run by request id, from `output` and its journal (either may be missing).

    Raises:
      ValueError: neither file exists, or one is not a paxkv output.
    """
    sources = [path for path in (output, journal_path(output)) if os.path.exists(path)]
    if not sources:
        raise ValueError(
            f"--resume: neither {output} nor {journal_path(output)} exists, so there is nothing to resume; "
            "run without --resume"
        )
    finished = {}
    for path in sources:
        for record in read_records(path):
            if "error" not in record and record.get("finish_reason") not in (None, "abort") and "id" in record:
                finished[str(record["id"])] = record
    return finished


def split_done(lines: list[PromptLine | BadLine], finished: dict[str, dict]) -> tuple[list, dict[int, dict]]:
    """(the lines still to run, {index in `lines`: the earlier record} for the lines already done).

    Raises:
      ValueError: naming every done line whose content or sampling fields changed since its record was written.
    """
    to_run, done, changed = [], {}, []
    for index, line in enumerate(lines):
        record = finished.get(line.request_id) if isinstance(line, PromptLine) else None
        if record is None:
            to_run.append(line)
        elif record.get("input_hash") != line.input_hash:
            changed.append(f"line {line.line_number} (id {line.request_id!r})")
        else:
            done[index] = record
    if changed:
        raise ValueError(
            f"--resume: {', '.join(changed)} changed since the earlier run finished it (prompt, messages, cache_salt "
            "or sampling fields, flags included); restore the line, give it a new id to run it again, or run "
            "without --resume"
        )
    return to_run, done


def merge(lines: list, to_run: list, new_records: list[dict], done: dict[int, dict]) -> list[dict]:
    """One record per line of `lines`, in order: the earlier record where done, else the new run's."""
    by_line = {id(line): record for line, record in zip(to_run, new_records, strict=True)}
    return [
        dict(done[index], line=line.line_number) if index in done else by_line[id(line)]
        for index, line in enumerate(lines)
    ]
