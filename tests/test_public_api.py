"""The public API: each package's `__init__.py` lists it (issue 38: at most 65 names), and a
name that left the listing still resolves for one release, with a DeprecationWarning."""

import types

import pytest

import eqx_lowmem as el

PACKAGES = ("data", "memory", "nn", "precision", "sparse", "train")


def _public(module: types.ModuleType) -> set[str]:
    return {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }


def test_the_public_api_has_at_most_65_names():
    names = {f"{p}.{n}" for p in PACKAGES for n in _public(getattr(el, p))}
    names |= _public(el) - {"annotations"}
    assert len(names) <= 65, sorted(names)
    # Each listed name is documented.
    for qualified in names:
        obj = el
        for part in qualified.split("."):
            obj = getattr(obj, part)
        if callable(obj):
            assert obj.__doc__, qualified


@pytest.mark.parametrize(
    "package, name, private",
    [
        ("nn", "PRESETS", "_remat"),
        ("precision", "stochastic_round", "_rounding"),
        ("train", "lock_directory", "_lock"),
        ("memory", "format_bytes", "_units"),
        ("sparse", "DSRState", "_rules"),
    ],
)
def test_a_removed_name_resolves_with_a_deprecation_warning(package, name, private):
    module = getattr(el, package)
    with pytest.warns(DeprecationWarning, match=rf"eqx_lowmem\.{package}\.{name} is no longer"):
        obj = getattr(module, name)
    assert obj is getattr(getattr(module, private), name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018
