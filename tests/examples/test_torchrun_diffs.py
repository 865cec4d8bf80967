"""Protecting a torchrun script stays a few lines: each example of examples/torchrun/ against its plain original.

The count is the launch benchmark's own (``benchmarks.parts.launch.changed_lines``: substantive lines, blank lines
and comments ignored, as ``diff -w``), so the figure docs/benchmarks.md reports and the limit held here are one
number.  docs/launch.md shows each diff; it must be the files' diff as it is now.  Pure: nothing runs.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from benchmarks.parts.launch import EXAMPLES, EXAMPLES_DIR, MAX_CHANGED, changed_lines, example_diffs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_changes_at_most_six_lines_of_its_plain_original(name):
    d = example_diffs()[name]
    assert MAX_CHANGED == 6
    assert 0 < d["changed"] <= MAX_CHANGED, d
    assert d["removed"] <= d["changed"], d  # the loop is rewritten, not dropped


def test_the_count_ignores_comments_blank_lines_and_indentation_but_not_code():
    """Negative control: a line of code added to the protected script counts, a comment or blank line or a
    re-indented block does not; a ``#`` inside a string is code."""
    plain_name, protected_name, _ = EXAMPLES["hydra"]
    plain, protected = (EXAMPLES_DIR / plain_name).read_text(), (EXAMPLES_DIR / protected_name).read_text()
    base = changed_lines(plain, protected)
    assert base["changed"] == 6 and base["removed"] == 2, base
    noisy = protected.replace("import os\n", "import os  # the environment\n\n\n# a comment of its own\n", 1)
    noisy = noisy.replace("    fully_shard(model, mesh=mesh)\n",
                          "    if True:\n            fully_shard(model,  mesh=mesh)\n")
    assert changed_lines(plain, noisy)["changed"] == base["changed"] + 1  # the `if True:`; not its re-indented body
    extra = protected.replace("    fully_shard(model, mesh=mesh)\n",
                              "    fully_shard(model, mesh=mesh)\n    print('# not a comment')\n")
    assert changed_lines(plain, extra)["changed"] == base["changed"] + 1
    assert changed_lines(plain, plain) == {"changed": 0, "removed": 0, "plain_lines": base["plain_lines"],
                                           "protected_lines": base["plain_lines"]}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docs_launch_shows_each_examples_diff_as_it_is(name):
    plain, protected, _ = EXAMPLES[name]
    diff = "".join(difflib.unified_diff((EXAMPLES_DIR / plain).read_text().splitlines(True),
                                        (EXAMPLES_DIR / protected).read_text().splitlines(True), plain, protected))
    assert diff.strip() and diff.rstrip("\n") in (REPO / "docs" / "launch.md").read_text(), (
        f"docs/launch.md's diff of {protected} against {plain} is not the files' diff; paste this one:\n{diff}")
