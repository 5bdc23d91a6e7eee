"""SIGINT and SIGTERM for batch runs: the first signal stops the run cleanly, a second exits at once.

Preemptible and spot VMs get SIGTERM before they go, and people press Ctrl-C. Either way the work that
finished must survive: the runner stops admitting work after the step in flight, aborts what is still
running, writes every result and exits 130 (SIGINT) or 143 (SIGTERM), as shells report those signals.
"""

import os
import signal
import sys

HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Signal handlers for one run, as a context manager; `requested` turns true at the first signal.

    Before `arm()` (while the model loads and nothing can be lost) a signal exits at once with its code.
    After it, the first signal only sets `requested`, and the run loop stops after the current step; a second
    signal exits at once (the journal holds every request finished until then).
    """

    def __init__(self):
        self.signal_number: int | None = None
        self._armed = False
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        for number in HANDLED:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def reinstall(self) -> None:
        """Take the signals back from whatever replaced the handlers (jax.distributed's SIGTERM notifier does)."""
        for number in HANDLED:
            signal.signal(number, self._handle)

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def arm(self) -> None:
        """From now on the first signal asks the run to stop instead of exiting."""
        self._armed = True

    @property
    def requested(self) -> bool:
        """Whether a signal has asked the run to stop."""
        return self.signal_number is not None

    @property
    def name(self) -> str:
        """The signal's name, e.g. "SIGTERM"."""
        return signal.Signals(self.signal_number).name

    @property
    def exit_code(self) -> int:
        """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signal_number

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if not self._armed:
            print(f"paxkv: {name} before any request ran; exiting", file=sys.stderr, flush=True)
            raise SystemExit(128 + number)
        if self.signal_number is not None:
            print(f"paxkv: second signal ({name}); exiting now, the journal holds what finished", file=sys.stderr)
            sys.stderr.flush()
            os._exit(128 + number)
        self.signal_number = number
        print(
            f"paxkv: {name}: stopping after this step and writing every finished result "
            "(a second signal exits at once)",
            file=sys.stderr,
            flush=True,
        )
