"""The README's two runnable examples, run as a user runs them, and timed.

- The main job: `examples/train_char_lm.py` at its defaults, from a fresh run directory.
  Recorded: the updates it trained, its last evaluation loss and the text's unigram entropy
  (nats per character), and its training seconds, as it prints them.
- The short example: the README's code block after `<!-- short-example -->`, as written, in
  a fresh directory. Recorded: the losses it prints.

For each, the wall seconds of its process and the CPU seconds it used (user + system, all
its threads: less moved than the wall time by other processes on a shared machine), with
the load average before and after. Each runs in a process of its own with the environment
this script has (XLA's default flags unless `XLA_FLAGS` says otherwise).

    python benchmarks/examples.py     # writes benchmarks/results/examples.json
"""

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "examples" / "train_char_lm.py"


def readme_block(marker: str) -> str:
    """The Python code block right after `<!-- marker -->` in the README."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(f"<!-- {marker} -->") :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```", start)]


def timed_run(args: list[str], timeout: float, files: dict[str, str] | None = None) -> tuple:
    """Run `python *args` in a fresh directory holding `files` (name: text): its stdout, and
    its wall seconds, CPU seconds and load average before and after."""
    with tempfile.TemporaryDirectory(prefix="example_") as tmp:
        for name, text in (files or {}).items():
            (Path(tmp) / name).write_text(text)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, *args], cwd=tmp, capture_output=True, text=True, timeout=timeout
        )
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed with exit code {done.returncode}:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{args[0]}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return done.stdout, {
        "wall_s": wall,
        "cpu_s": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"the output has no match for {pattern!r}:\n{text[-3000:]}")
    return float(found.group(1).replace(",", ""))


def main_job(timeout: float) -> dict:
    out, run = timed_run([str(MAIN_JOB), "--run-dir", ".", "--no-progress"], timeout)
    return {
        "command": "python examples/train_char_lm.py (defaults, a fresh --run-dir)",
        "updates": int(_number(r"trained (\d+) update\(s\)", out)),
        "train_seconds": _number(r"update\(s\) in this run \((\d+)s\)", out),
        "final_eval_loss": _number(r"final eval loss ([\d.]+) nats", out),
        "unigram_entropy": _number(r"unigram entropy ([\d.]+) nats", out),
        **run,
        "output_tail": out[-2000:],
    }


def short_example(timeout: float) -> dict:
    out, run = timed_run(["example.py"], timeout, {"example.py": readme_block("short-example")})
    last = out.strip().splitlines()[-1]
    if not last.startswith("train loss per epoch: ["):
        raise RuntimeError(f"the short example printed no losses:\n{out[-3000:]}")
    losses = [float(x) for x in last.split("[", 1)[1].rstrip("]").split(",")]
    return {"command": "the README's short example", "train_loss": losses, **run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per example")
    args = parser.parse_args()
    results = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "short_example": short_example(args.timeout),
        "main_job": main_job(args.timeout),
    }
    m = results["main_job"]
    print(f"main job: {m['updates']} updates, eval loss {m['final_eval_loss']:.3f}")
    print(f"wrote {write_json('examples', results)}")


if __name__ == "__main__":
    main()
