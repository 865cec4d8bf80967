"""docs/job-file.md cannot drift from the code: its tables name every field of the configuration, with the default
``JobConfig()`` has and the lower bounds the validation enforces.  Pure: parses the page, builds configurations."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import yaml

from accelpact_slurm.core.config import JobConfig, from_dict
from accelpact_slurm.core.errors import ConfigError
from tests.conftest import REPO

DOC = os.path.join(REPO, "docs", "job-file.md")
_ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|\s*`([^`]*)`\s*\|(.*)\|\s*([^|]*)\|\s*$")


def _rows() -> dict[str, tuple[str, str]]:
    """``{dotted field: (default as written, valid as written)}`` of every table row of the page."""
    rows: dict[str, tuple[str, str]] = {}
    with open(DOC, encoding="utf-8") as fh:
        for line in fh:
            m = _ROW.match(line)
            if m:
                assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
                rows[m.group(1)] = (m.group(2), m.group(4).strip())
    return rows


def _defaults() -> dict[str, object]:
    """``{dotted field: default}`` of a default-constructed configuration, as the job file would spell it."""
    cfg = JobConfig()
    out: dict[str, object] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                out[f"{f.name}.{sub.name}"] = getattr(value, sub.name)
        else:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def test_every_field_is_documented_once_and_nothing_else():
    assert sorted(_rows()) == sorted(_defaults())


def test_documented_defaults_equal_the_codes():
    rows, defaults = _rows(), _defaults()
    wrong = {}
    for name, want in defaults.items():
        written = rows[name][0]
        got = yaml.safe_load(written)
        if type(got) is not type(want) or got != want:  # 5 is not 5.0, "0" is not 0: the type is part of it
            wrong[name] = (written, want)
    assert wrong == {}


def test_documented_lower_bounds_are_the_ones_enforced():
    """``>= N`` of an integer field: N passes the validation, N - 1 is refused naming the field."""
    rows, defaults = _rows(), _defaults()
    checked = []
    for name, (_, valid) in rows.items():
        m = re.match(r"`>= (\d+)`", valid)
        if not m or not isinstance(defaults[name], int) or isinstance(defaults[name], bool):
            continue
        bound = int(m.group(1))
        section, _, key = name.rpartition(".")

        def data(value):
            return {section: {key: value}} if section else {key: value}

        from_dict(data(bound))
        with pytest.raises(ConfigError) as exc:
            from_dict(data(bound - 1))
        assert exc.value.args and name in str(exc.value), (name, str(exc.value))
        checked.append(name)
    assert {"steps", "log_every", "topology.nodes", "checkpoint.keep_last", "checkpoint.shared_keep",
            "recovery.max_stalled_restarts"} <= set(checked)
