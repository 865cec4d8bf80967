"""A training script run as torchrun runs it: what its ranks are told (pure, no torch).

``accelpact-run [flags] train.py --its --own --args`` runs ``train.py`` as ``__main__`` on every rank (script mode).
The job's entry is then ``PATH.py:__main__`` (or ``package.module:__main__`` for ``-m``): the file, or the module,
run as a program, not a function called with the Job.  The script gets its Job from one call,
the package's ``init(steps=..., seed=...)``, whose values are the single source of truth for the training's
length and seed; a job file (or a flag) that fixed one of them to another value is an error naming both.

:class:`ScriptSpec` carries what the launcher knows and the rank needs: the script's own arguments and the values
the job's side fixed, with where each came from.  It travels to every rank as one JSON argument of the worker entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from accelpact_slurm.core.errors import ConfigError

#: The function name of an entry that is a program run as ``__main__`` rather than a function called with the Job.
MAIN = "__main__"
#: What the package's ``init()`` takes that a job file (or a flag) may also fix.
FIXABLE = ("steps", "seed")


def is_script_entry(entry: str) -> bool:
    """Whether ``entry`` names a program (``train.py:__main__``, ``pkg.train:__main__``), not a function."""
    return entry.rpartition(":")[2] == MAIN


def script_entry(target: str, *, module: bool = False) -> str:
    """The job's entry for a script path (``train.py``) or, with ``module``, a module name (``pkg.train``)."""
    return f"{target}:{MAIN}" if module or target.endswith(".py") else f"{target}.py:{MAIN}"


@dataclass(frozen=True)
class Fixed:
    """A value of steps or seed the job's side fixed, and where (``job file a.yaml``, ``--steps``)."""

    value: int
    source: str


@dataclass(frozen=True)
class ScriptSpec:
    """What a rank needs besides the job file: the script's own arguments (``sys.argv[1:]``) and the values of
    :data:`FIXABLE` the job's side fixed (absent: the script's call, else the default, decides)."""

    argv: tuple[str, ...] = ()
    fixed: Mapping[str, Fixed] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"argv": list(self.argv),
                           "fixed": {k: {"value": f.value, "source": f.source} for k, f in self.fixed.items()}},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ScriptSpec":
        """Parse :meth:`to_json`'s text; a :class:`ConfigError` names what is wrong with it."""
        try:
            data = json.loads(text)
            argv = tuple(data.get("argv", ()))
            fixed = {k: Fixed(int(v["value"]), str(v["source"])) for k, v in data.get("fixed", {}).items()}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ConfigError("--script-spec", text[:80], f"not the launcher's script spec ({exc}); start the job "
                                                          f"with accelpact-run") from None
        if not all(isinstance(a, str) for a in argv) or set(fixed) - set(FIXABLE):
            raise ConfigError("--script-spec", text[:80], "not the launcher's script spec; start the job with "
                                                          "accelpact-run")
        return cls(argv=argv, fixed=fixed)


def fixed_values(raw: Mapping[str, Any] | None, source: str, flags: Mapping[str, int | None]) -> dict[str, Fixed]:
    """Which of steps and seed the job's side fixed (pure): a top-level key of the job file's YAML (``raw``,
    read from ``source``), overridden by a flag (``flags``: ``{"steps": 7}``, None where not given)."""
    out: dict[str, Fixed] = {}
    for key in FIXABLE:
        if raw is not None and isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool):
            out[key] = Fixed(raw[key], f"the job file {source}")
        flag = flags.get(key)
        if flag is not None:
            out[key] = Fixed(int(flag), f"--{key}")
    return out


def conflict(key: str, mine: int, fixed: Fixed) -> ConfigError | None:
    """The error for a script's ``init(key=mine)`` against a value the job's side fixed; None when they agree."""
    if mine == fixed.value:
        return None
    return ConfigError(key, mine, f"the script passes {key}={mine} to accelpact_slurm.init(), but {fixed.source} "
                                  f"says {key}: {fixed.value}; the script's value is the one source: remove "
                                  f"{key} from {fixed.source.replace('the job file ', '')}, or make the two equal")
