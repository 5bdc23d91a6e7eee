"""Where a batch run's results go: paths checked before the model loads, a journal, and atomic final files.

A run writes each finished request to `<output>.journal` as soon as it finishes (one JSON line, flushed), and
the whole `--output`, in input order, only at the end: to a temporary file beside it, renamed into place. So a
crash or a kill never leaves a half-written file under the real name, and what finished is in the journal.
"""

import hashlib
import json
import os
import tempfile

JOURNAL_SUFFIX = ".journal"


def check_writable(path: str, flag: str) -> None:
    """Raise ValueError, naming the flag and the fix, unless `path` can be written as a file.

    The check creates (and removes) a temporary file in the target's folder, so a read-only mount or a full
    quota fails here, before the model loads, rather than after the run.

    Args:
      path: the file to be written.
      flag: the command-line flag that named it, for the message (e.g. "--output").
    """
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {os.path.join(path, 'results.jsonl')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another path")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} exists and is not writable; change its permissions or choose another path")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".paxkv-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose another path") from None


def write_atomically(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def jsonl(records: list[dict]) -> str:
    """Records as JSON lines (UTF-8 kept as is)."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def journal_path(output: str) -> str:
    """The journal beside `output`."""
    return output + JOURNAL_SUFFIX


class Journal:
    """An append-only JSONL file of finished records, each flushed to the OS as it is written.

    A flushed line survives the process being killed (even with SIGKILL); only the line being written at that
    moment can be torn, and read_records ignores a torn last line.
    """

    def __init__(self, path: str, *, keep_existing: bool):
        """Open `path` for appending (created if missing).

        Args:
          path: the journal file, usually journal_path(output).
          keep_existing: append to what an earlier run wrote (--resume); otherwise start it empty.
        """
        self.path = path
        if not keep_existing and os.path.exists(path):
            os.remove(path)
        if os.path.exists(path):
            _drop_torn_last_line(path)  # a killed run's half-written record must not precede the new ones
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run)

    def append(self, record: dict) -> None:
        """Write one record as a line and flush it."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()

    def remove(self) -> None:
        """Close and delete the journal (once the full output holds everything it held)."""
        self.close()
        os.remove(self.path)


def _drop_torn_last_line(path: str) -> None:
    """Truncate `path` after its last newline (removing a line a killed writer left unfinished)."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def read_records(path: str) -> list[dict]:
    """The JSON records of a JSONL output or journal; a torn (unparseable) last line is skipped.

    Raises:
      ValueError: a line other than the last is not a JSON object (the file is not one paxkv wrote).
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the line a killed run was writing
            raise ValueError(f"{path}:{number}: not a JSON line; this is not a paxkv output or journal") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object; this is not a paxkv output or journal")
        records.append(record)
    return records


def request_hash(prompt, messages, cache_salt, sampling_fields: dict) -> str:
    """A short hash of what decides a request's output: its prompt or messages, salt and sampling fields."""
    content = json.dumps(
        {"prompt": prompt, "messages": messages, "cache_salt": cache_salt, "sampling": sampling_fields},
        sort_keys=True,
        ensure_ascii=False,
        default=list,
    )
    return hashlib.sha256(content.encode("utf-8", errors="surrogatepass")).hexdigest()[:16]
