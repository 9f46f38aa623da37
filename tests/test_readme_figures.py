"""The README's measured figures are those of the committed JSON: `benchmarks/readme_figures.py`
writes them, and this file fails when the README and `benchmarks/results/` disagree."""

import pytest

from .helpers import load_benchmark


@pytest.fixture(scope="module")
def figures():
    return load_benchmark("readme_figures")


def test_every_generated_figure_in_the_readme_is_its_jsons(figures):
    _, changed = figures.render(figures.README.read_text())
    assert not changed, (
        f"README.md's figures {changed} differ from benchmarks/results/*.json: run "
        "`python benchmarks/readme_figures.py` (after rerunning the benchmark)."
    )


def test_a_figure_edited_by_hand_is_caught(figures):
    readme = figures.README.read_text()
    start = readme.index("<!-- figures:data -->")
    edited = readme[:start] + readme[start:].replace("9.54 distinct", "9.52 distinct", 1)
    assert edited != readme
    fixed, changed = figures.render(edited)
    assert changed == ["data"] and fixed == readme


def test_every_marker_names_a_section_and_every_section_has_a_marker(figures):
    readme = figures.README.read_text()
    with pytest.raises(ValueError, match=r"unknown \['nothing'\]"):
        figures.render(readme + "<!-- figures:nothing -->\n<!-- /figures:nothing -->\n")
    start = readme.index("<!-- figures:remat -->")
    end = readme.index("<!-- /figures:remat -->\n") + len("<!-- /figures:remat -->\n")
    with pytest.raises(ValueError, match=r"missing \['remat'\]"):
        figures.render(readme[:start] + readme[end:])
