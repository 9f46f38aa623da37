"""Every `Example:` in a docstring of the package runs, as a doctest."""

import doctest
import importlib
import pkgutil

import pytest

import eqx_lowmem

# Modules whose examples need an optional package (an extra of pyproject.toml).
OPTIONAL = {
    "eqx_lowmem.train._orbax": "orbax.checkpoint",
    "eqx_lowmem.train._tensorboard": "tensorboardX",
}


def _modules() -> list[str]:
    names = [eqx_lowmem.__name__]
    for info in pkgutil.walk_packages(eqx_lowmem.__path__, prefix="eqx_lowmem."):
        names.append(info.name)
    return sorted(names)


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    # Only docstrings defined in this module (re-exports are tested where they live).
    return [
        t
        for t in finder.find(module, name)
        if t.examples and (t.filename or "").endswith(module.__file__.rsplit("/", 1)[-1])
    ]


def test_the_package_has_examples():
    assert sum(len(_examples(name)) for name in _modules()) >= 10


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name], reason=f"{OPTIONAL[name]} is not installed")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(name):
        result = runner.run(test, clear_globs=True)
        assert result.failed == 0, f"{test.name}: {result.failed} of {result.attempted} failed"
