"""The parent's side of scripts/bench_throughput.py's worker protocol: start a worker, send it JSON commands,
read its JSON answers (throughput_worker.py is the other side), and let the machine settle between calls."""

import json
import os
import select
import signal
import subprocess
import sys
import time

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "throughput_worker.py")
REPLY_TIMEOUT_S = 3600


def cpu_busy_fraction(window_s: float) -> float | None:
    """The share of the machine's CPU time spent busy over the next window_s seconds (/proc/stat); None elsewhere."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(value) for value in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    before = sample()
    time.sleep(window_s)
    after = sample()
    if before is None or after is None or after[0] == before[0]:
        return None
    return 1.0 - (after[1] - before[1]) / (after[0] - before[0])


def settle(min_s: float, max_s: float = 15.0, busy_below: float = 0.1, window_s: float = 0.25) -> float:
    """Wait min_s, then until the machine is idle (busy under busy_below of its CPU time over a window) or max_s has
    passed: a peer's threads that still spin after its call (vllm's engine core) must not slow the next system's
    call. Returns the seconds waited."""
    start = time.perf_counter()
    time.sleep(min_s)
    while time.perf_counter() - start < max_s:
        busy = cpu_busy_fraction(window_s)
        if busy is None or busy < busy_below:
            break
    return time.perf_counter() - start


class WorkerError(RuntimeError):
    """A worker failed, died or went silent."""


class Worker:
    """One worker subprocess and its JSON-lines protocol."""

    def __init__(self, python: str, spec: dict, env: dict):
        """Start the worker; it loads its model in the background until wait_ready.

        Args:
          python: the interpreter to run this file with.
          spec: the worker spec.
          env: the worker's environment.
        """
        self.name = f"{spec['system']}/{spec['model']}"
        self.proc = subprocess.Popen(
            [python, WORKER_SCRIPT, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, so close() can end the engine processes it starts
        )
        self._buffer = b""

    def receive(self, timeout_s: float) -> dict:
        """The worker's next JSON message; raises WorkerError on an error message, exit or timeout.

        Args:
          timeout_s: the longest wait.
        """
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                    raise WorkerError(f"{self.name}: no answer within {timeout_s:.0f} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkerError(f"{self.name}: exited with code {self.proc.wait()} (see its stderr above)")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                print(f"[{self.name} stdout] {line.decode(errors='replace')}", file=sys.stderr)
                continue
            if message.get("event") == "error":
                raise WorkerError(f"{self.name} failed:\n{message['message']}")
            return message

    def request(self, command: dict, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        """Send one command and return the answer.

        Args:
          command: the JSON command.
          timeout_s: the longest wait for the answer.
        """
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"{self.name}: exited with code {self.proc.wait()}") from None
        return self.receive(timeout_s)

    def ask_to_quit(self) -> None:
        """Send quit and close the worker's input; a second call does nothing."""
        try:
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass

    def close(self) -> None:
        """Ask the worker to quit; end its process group if it has not within a minute."""
        self.ask_to_quit()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait_s)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        self.proc.stdout.close()
