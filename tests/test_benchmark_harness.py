"""benchmarks/_common.py, the harness every benchmark script uses: interleaved timing
rounds, worker processes pinned one per core, the environment record."""

import json
import os
import sys
import textwrap

import pytest

from .helpers import load_benchmark

common = load_benchmark("_common")


def test_interleaved_rounds_alternate_the_order_and_time_every_call():
    order = []
    calls = {name: (lambda n=name: order.append(n)) for name in "abc"}
    wall = common.interleaved(calls, 3)
    assert order == list("abccbaabc")  # ABBA: drift weighs on all alike
    assert list(wall) == list("abc") and all(len(t) == 3 for t in wall.values())
    assert all(t >= 0 for times in wall.values() for t in times)
    assert common.median_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0  # of 2, 3, 4


WORKER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {benchmarks!r})
    from _common import worker_main

    def work(spec):
        if spec["fail"]:
            raise SystemExit(3)
        time.sleep(spec.get("sleep", 0))
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {{"square": spec["n"] ** 2, "cores": cores, "env": os.environ.get("MARK")}}

    if __name__ == "__main__":
        sys.exit(worker_main(sys.argv[2], work))
    """
)


@pytest.mark.slow  # worker processes, each importing JAX
def test_run_workers_runs_each_spec_in_a_fresh_process_in_order(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(benchmarks=str(common.RESULTS.parent)))
    specs = [{"n": n, "fail": False, "label": f"n={n}"} for n in (3, 2)]
    outs = common.run_workers(script, specs, parallel=2, env={"MARK": "set"})
    assert [o["square"] for o in outs] == [9, 4]  # in the order of the specs
    assert {o["env"] for o in outs} == {"set"}  # this environment, updated
    bad = [*specs[:1], {"n": 1, "fail": True, "label": "the bad one"}]
    with pytest.raises(RuntimeError, match="worker workers failed: the bad one exit code 3"):
        common.run_workers(script, bad, parallel=2)
    slow = [{"n": 1, "fail": False, "sleep": 30, "label": "the slow one"}]
    with pytest.raises(RuntimeError, match="the slow one ran past 1 s"):
        common.run_workers(script, slow, timeout=1)


@pytest.mark.slow  # worker processes, each importing JAX
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_pinned_workers_each_run_on_a_core_of_their_own(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(benchmarks=str(common.RESULTS.parent)))
    specs = [{"n": n, "fail": False, "sleep": 0.5} for n in range(4)]
    outs = common.run_workers(script, specs, parallel=2, pin=True)
    cores = common.cores()
    assert all(len(o["cores"]) == 1 and o["cores"][0] in cores for o in outs)
    if len(cores) > 1:  # two at a time, never both on one core
        assert len({o["cores"][0] for o in outs}) == 2


def test_results_carry_the_environment(tmp_path):
    path = common.write_json("r", {"x": 1}, directory=tmp_path)
    record = json.loads(path.read_text())
    assert record["x"] == 1 and record["environment"]["python"] == sys.version.split()[0]
    assert {"jax", "jaxlib", "equinox", "optax", "numpy"} <= set(record["environment"]["versions"])
