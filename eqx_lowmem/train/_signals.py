"""Stop requests during `fit`: Ctrl-C (SIGINT), SIGTERM (a scheduler's preemption, `kill`)
and SIGHUP (a closed terminal) each finish the update in flight, save and stop; a second
one stops at once."""

import contextlib
import signal
import sys
import threading

from ._resume import save
from ._run import Run

# The signals `fit` turns into "save, then stop". SIGHUP where the platform has it; a signal
# that the process ignores (SIGHUP under `nohup`) stays ignored.
_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def sigint(trainer):
    """Turn the first stop signal into a request to stop after the update in flight."""
    trainer._interrupted = False
    trainer._signal = None
    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()  # signals reach only the main thread

    def handler(signum, frame):
        if trainer._interrupted:  # a second signal: stop now, without saving
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        trainer._interrupted = True
        trainer._signal = signum

    stack = contextlib.ExitStack()
    for signum in _SIGNALS:
        if signum != signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous = signal.signal(signum, handler)
        stack.callback(signal.signal, signum, previous)
    return stack


def check_interrupt(trainer, run: Run) -> None:
    """After a stop signal: save, then exit the program (status 128 + the signal's number:
    130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP) or raise KeyboardInterrupt."""
    if not trainer._interrupted:
        return
    save(trainer, run)
    saved = trainer.checkpoint_dir is not None
    signum = trainer._signal or signal.SIGINT
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    if trainer.interrupt == "raise":
        raise KeyboardInterrupt(f"{how} at update {trainer.updates}")
    line = (
        f"{how} at update {trainer.updates}; run again to resume"
        if saved
        else f"{how} at update {trainer.updates}; no checkpoint_dir, nothing was saved"
    )
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
