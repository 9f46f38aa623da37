"""The README's measured figures are those of the committed JSON: `benchmarks/readme.py`
writes them, and this file fails when the README and `benchmarks/results/` disagree."""

import pytest

from .helpers import load_benchmark


@pytest.fixture(scope="module")
def figures():
    return load_benchmark("readme")


def test_every_generated_figure_in_the_readme_is_its_jsons(figures):
    _, changed = figures.render(figures.README.read_text())
    assert not changed, (
        f"README.md's figures {changed} differ from benchmarks/results/*.json: run "
        "`python benchmarks/readme.py` (after rerunning the benchmark)."
    )


@pytest.mark.parametrize(
    ("section", "figure", "edited_figure"),
    [
        ("data", "| 0.97x | at least 0.9x |", "| 0.95x | at least 0.9x |"),
        ("guide", "| 0.133x | at most 0.2x | met |", "| 0.130x | at most 0.2x | met |"),
    ],
)
def test_a_figure_edited_by_hand_is_caught(figures, section, figure, edited_figure):
    readme = figures.README.read_text()
    start = readme.index(f"<!-- figures:{section} -->")
    edited = readme[:start] + readme[start:].replace(figure, edited_figure, 1)
    assert edited != readme
    fixed, changed = figures.render(edited)
    assert changed == [section] and fixed == readme


def test_every_marker_names_a_section_and_every_section_has_a_marker(figures):
    readme = figures.README.read_text()
    with pytest.raises(ValueError, match=r"unknown \['nothing'\]"):
        figures.render(readme + "<!-- figures:nothing -->\n<!-- /figures:nothing -->\n")
    start = readme.index("<!-- figures:guide -->")
    end = readme.index("<!-- /figures:guide -->\n") + len("<!-- /figures:guide -->\n")
    with pytest.raises(ValueError, match=r"missing \['guide'\]"):
        figures.render(readme[:start] + readme[end:])
