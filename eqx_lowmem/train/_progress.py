"""The Trainer's progress: a bar on a terminal, a line every few seconds otherwise."""

import sys
import time

from tqdm.auto import tqdm

from ._hooks import Hook, StepInfo


class Progress(Hook):
    """A bar on a terminal; a line every `seconds` otherwise (`progress=True`); `"bar"` or
    `"log"` force one."""

    def __init__(self, progress: bool | str, seconds: float | int):
        mode = progress
        if progress is True:
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode if mode in ("bar", "log") else None
        self.seconds = seconds
        self.target: int | None = None
        self.first: tuple[float, int] | None = None  # (time, updates) after the first update
        self.last_line = time.monotonic()
        self.bar = None

    def on_start(self, info: StepInfo) -> None:
        self.target, self.first, self.last_line = info.target, None, time.monotonic()
        if self.mode == "bar":
            self.bar = tqdm(total=self.target, file=sys.stderr, leave=False, unit="update")

    def on_update(self, info: StepInfo) -> None:
        self.update(info.update, float(info.metrics["loss"]), info.epoch)

    def update(self, updates: int, loss: float, epoch: int) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, updates)  # after the first update: it includes compiling
            if self.bar is not None:
                self.bar.n = updates - 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", refresh=False)
        elif self.mode == "log" and now - self.last_line >= self.seconds:
            self.last_line = now
            print(self.line(updates, loss, epoch, now), file=sys.stderr, flush=True)

    def line(self, updates: int, loss: float, epoch: int, now: float) -> str:
        assert self.first is not None
        t0, u0 = self.first
        rate = (updates - u0) / (now - t0) if updates > u0 and now > t0 else None
        of = f"/{self.target}" if self.target is not None else ""
        parts = [f"update {updates}{of}", f"epoch {epoch + 1}", f"loss {loss:.4f}"]
        parts.append(f"{rate:.3g} updates/s" if rate else "- updates/s")
        if rate and self.target is not None:
            parts.append(f"ETA {_duration((self.target - updates) / rate)}")
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
