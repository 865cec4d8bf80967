"""The event log reader: a hostile line is one bad line, never an exception; event text made safe to print."""

from __future__ import annotations

import json

import pytest

from accelpact_slurm.core import events as ev
from accelpact_slurm.core.events import BadLine, read_events

GOOD = json.dumps({"ts": 1.0, "event": "step", "step": 1})


def _read(tmp_path, lines: list[str]) -> tuple[list[dict], list[BadLine]]:
    p = tmp_path / "events.jsonl"
    p.write_text("\n".join(lines) + "\n")
    bad: list[BadLine] = []
    return list(read_events(p, bad)), bad


@pytest.mark.parametrize("line", [
    "[" * 200_000 + "]" * 200_000,  # json's decoder: RecursionError
    '{"a":' * 200_000 + "1" + "}" * 200_000,
    # parses, but 150 levels would put every later reader (json.dumps for --json) near the recursion limit
    '{"ts": 2.0, "event": "fail_stop", "reason": ' + "[" * 150 + "]" * 150 + "}",
])
def test_deeply_nested_line_is_a_bad_line(tmp_path, line):
    records, bad = _read(tmp_path, [GOOD, line, GOOD])
    assert len(records) == 2
    assert [b.lineno for b in bad] == [2] and "nested deeper than" in bad[0].reason


def test_ordinary_nesting_is_kept(tmp_path):
    cfg = {"event": "job_start", "ts": 1.0, "config": {"params": {"a": {"b": {"c": [[1, 2], [3]]}}}}}
    records, bad = _read(tmp_path, [json.dumps(cfg)])
    assert records == [cfg] and bad == []


@pytest.mark.parametrize("ts", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity",
                                pytest.param("1" + "0" * 400, id="int-400-digits")])
def test_ts_that_is_no_finite_number_is_a_bad_line(tmp_path, ts):
    line = '{"ts": ' + ts + ', "event": "step", "step": 2}'
    records, bad = _read(tmp_path, [GOOD, line])
    assert len(records) == 1
    assert [b.lineno for b in bad] == [2] and "'ts'" in bad[0].reason


def test_ts_of_another_type_stays_lenient(tmp_path):
    # A string ts reads as "no time" (the status and cadence readers skip it), as before.
    records, bad = _read(tmp_path, ['{"ts": "x", "event": "step"}'])
    assert len(records) == 1 and bad == []


@pytest.mark.parametrize("value, number", [(1, 1.0), (2.5, 2.5), (float("nan"), None), (float("inf"), None),
                                           pytest.param(10 ** 400, None, id="int-400-digits"), (True, None),
                                           ("3", None), (None, None)])
def test_finite_number(value, number):
    assert ev.finite_number(value) == number


@pytest.mark.parametrize("text, shown", [
    ("plain text", "plain text"),
    ("\x1b[2Jcleared", "\\x1b[2Jcleared"),
    ("two\nlines\r", "two\\nlines\\r"),
    ("bell\x07 csi\x9b", "bell\\x07 csi\\x9b"),
    ("rtl\u202eevil", "rtl\\u202eevil"),
    ("ünïcode ok", "ünïcode ok"),
])
def test_printable_escapes_control_characters(text, shown):
    assert ev.printable(text) == shown


def test_printable_tree_escapes_keys_and_values_and_keeps_the_rest():
    tree = {"reason\x1b": ["a\x1b[31m", 1.5, None, {"k": "\x07"}], "n": 3}
    assert ev.printable_tree(tree) == {"reason\\x1b": ["a\\x1b[31m", 1.5, None, {"k": "\\x07"}], "n": 3}
