"""Ctrl-C during `fit`: the first finishes the update in flight, saves and stops; a second
stops at once."""

import contextlib
import signal
import sys
import threading

from ._resume import save
from ._run import Run


class _handling:
    """Install a signal handler for a `with` block, restoring the previous one after."""

    def __init__(self, signum, handler):
        self.signum, self.handler = signum, handler

    def __enter__(self):
        self.previous = signal.signal(self.signum, self.handler)
        return self

    def __exit__(self, *exc):
        signal.signal(self.signum, self.previous)
        return False


def sigint(trainer):
    """Turn the first Ctrl-C into a request to stop after the update in flight."""
    trainer._interrupted = False
    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()  # signals reach only the main thread

    def handler(signum, frame):
        if trainer._interrupted:  # a second Ctrl-C: stop now, without saving
            raise KeyboardInterrupt
        trainer._interrupted = True

    return _handling(signal.SIGINT, handler)


def check_interrupt(trainer, run: Run) -> None:
    """After a Ctrl-C: save, then exit the program (status 130) or raise KeyboardInterrupt."""
    if not trainer._interrupted:
        return
    save(trainer, run)
    saved = trainer.checkpoint_dir is not None
    if trainer.interrupt == "raise":
        raise KeyboardInterrupt(f"interrupted at update {trainer.updates}")
    line = (
        f"interrupted at update {trainer.updates}; run again to resume"
        if saved
        else f"interrupted at update {trainer.updates}; no checkpoint_dir, nothing was saved"
    )
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(130)
