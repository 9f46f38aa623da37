"""Stop requests during `fit`: Ctrl-C (SIGINT), SIGTERM (a scheduler's preemption, `kill`)
and SIGHUP (a closed terminal) each finish the update in flight, save and stop; a second
one stops at once."""

import contextlib
import signal
import sys
import threading

from ._hooks import Hook, StepInfo

# The signals `fit` turns into "save, then stop". SIGHUP where the platform has it; a signal
# that the process ignores (SIGHUP under `nohup`) stays ignored.
_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Interrupts(Hook):
    """The first stop signal during `fit` becomes a request to stop after the update in
    flight; the run's end (the checkpoint hook, before this one, saves there) then exits
    the program (`how="exit"`: status 128 + the signal's number, 130 for Ctrl-C, 143 for
    SIGTERM, 129 for SIGHUP) or raises KeyboardInterrupt (`how="raise"`). Only in the main
    thread (Python delivers signals there)."""

    def __init__(self, how: str = "exit", saving: bool = False):
        self.how = how
        self.saving = saving  # a checkpoint is saved before the stop
        self.signal: int | None = None  # the signal that arrived during this fit
        self._handlers: contextlib.ExitStack | None = None

    def _handler(self, signum, frame) -> None:
        if self.signal is not None:  # a second signal: stop now, without saving
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signal = signum

    def on_start(self, info: StepInfo) -> None:
        self.signal = None
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread
        stack = contextlib.ExitStack()
        for signum in _SIGNALS:
            if signum != signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                continue
            previous = signal.signal(signum, self._handler)
            stack.callback(signal.signal, signum, previous)
        self._handlers = stack

    def due(self, update: int) -> bool:
        return self.signal is not None

    def on_update(self, info: StepInfo) -> None:
        if self.signal is not None:
            info.stop()

    def on_end(self, info: StepInfo) -> None:
        """After a signal: exit the program or raise KeyboardInterrupt."""
        if self.signal is None:
            return
        self.close()
        signum = self.signal
        name = signal.Signals(signum).name
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {name}"
        if self.how == "raise":
            raise KeyboardInterrupt(f"{how} at update {info.update}")
        line = (
            f"{how} at update {info.update}; run again to resume"
            if self.saving
            else f"{how} at update {info.update}; no checkpoint_dir, nothing was saved"
        )
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def close(self) -> None:
        if self._handlers is not None:
            self._handlers.close()
            self._handlers = None
