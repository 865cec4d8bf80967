"""The recovery envelope: which recovery action is qualified for which observation key.

An observation key is ``<platform stack, resource profile, failure phase, continuation objective>``.  An entry lists
the actions qualified for a key with their evidence (trials, successes, date, torch and backend versions); it is
earned by ``accelpact-qualify`` on that platform.  No entry, or an entry without enough successful trials, means
Restart.

Which file a job reads (:func:`load`): an explicitly configured file (``ACCELPACT_ENVELOPE``) alone; else the user's
file (:func:`user_path`, where ``accelpact-qualify`` writes by default) layered over the one shipped in the package
(:data:`SHIPPED`), the user's entry winning for a key both hold.

Pure: :func:`decide` takes the envelope and the key and returns
``(action, reason)``.  This module does not import torch.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from accelpact_slurm.core.errors import ConfigError

PRESERVE = "preserve"
RESTART = "restart"
ACTIONS = (PRESERVE, RESTART)
MIN_TRIALS = 3
DEFAULT_OBJECTIVE = "exact"
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
                       "envelope.yaml")
#: The torch releases the project supports and tests (``make test`` runs each; ``setup.cfg``'s range spans their
#: minors), and for which the shipped envelope holds CPU/Gloo keys earned by accelpact-qualify trials
#: (``scripts/earn_envelope.py``).
SUPPORTED_RELEASES = ("2.13.0", "2.14.1", "2.15.0")
#: The user's envelope, relative to their configuration directory (:func:`user_path`).
USER_FILE = os.path.join("accelpact", "envelope.yaml")


@dataclass(frozen=True)
class Key:
    platform: str
    profile: str
    phase: str
    objective: str = DEFAULT_OBJECTIVE

    def __str__(self) -> str:
        return f"<{self.platform}, {self.profile}, {self.phase}, {self.objective}>"

    def as_dict(self) -> dict[str, str]:
        return {"platform": self.platform, "profile": self.profile, "phase": self.phase, "objective": self.objective}


@dataclass
class Entry:
    key: Key
    actions: tuple[str, ...]
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key.as_dict(), "actions": list(self.actions), "evidence": dict(self.evidence)}


@dataclass
class Envelope:
    """Entries, at most one per key; ``path``: the file read (for the layered lookup, the user's file)."""

    entries: list[Entry] = field(default_factory=list)
    path: str | None = None

    def find(self, key: Key) -> Entry | None:
        for e in self.entries:
            if e.key == key:
                return e
        return None

    def upsert(self, entry: Entry) -> None:
        self.entries = [e for e in self.entries if e.key != entry.key] + [entry]


def release_of(torch_version: str) -> str:
    """The public release of a torch version: ``2.14.1+cu130`` -> ``2.14.1`` (the build label dropped)."""
    return torch_version.split("+", 1)[0]


def platform_key(torch_version: str, backend: str) -> str:
    """``torch-<release>/<backend>``.

    The release is matched exactly, patch included, and the build label is not part of it:

    * the build label (``+cpu``, ``+cu130``) names how torch was compiled, not the Python code of FSDP, DeviceMesh
      and c10d that the repair reaches into, so a CPU build and a CUDA build of one release share a CPU/Gloo key
      (a GPU key names its NCCL and CUDA versions besides: :attr:`.hardware.Hardware.platform`);
    * a patch release gets no L1 from its sibling: patch releases do move that private state (2.14.1 deprecated
      the c10d call that sets a group's timeout), and the exactness a key promises was shown on one release.
      Nobody loses it silently either: a job on an unqualified release says so when it starts
      (:func:`coverage_note`), with the command that earns the key.
    """
    return f"torch-{release_of(torch_version)}/{backend}"


def _minor(platform: str) -> tuple[str, str]:
    """``("2.14", "gloo")`` of ``torch-2.14.1/gloo``; ``("", platform)`` for another form."""
    head, _, backend = platform.partition("/")
    release = head[len("torch-"):] if head.startswith("torch-") else ""
    return ".".join(release.split(".")[:2]), backend


def coverage_note(envelope: "Envelope", key_for, min_trials: int = MIN_TRIALS) -> str | None:
    """None when L1 is qualified for this job in every qualifiable phase; else the line a job prints when it
    starts: what is not qualified, what a replication fault does then, a qualified sibling release if there is
    one, and the command that earns the key."""
    missing = [ph for ph in QUALIFIABLE_PHASES if decide(envelope, key_for(ph), min_trials)[0] != PRESERVE]
    if not missing:
        return None
    key = key_for(missing[0])
    minor, backend = _minor(key.platform)
    siblings = sorted({e.key.platform for e in envelope.entries
                       if e.key.profile == key.profile and e.key.platform != key.platform and minor
                       and _minor(e.key.platform) == (minor, backend) and PRESERVE in e.actions})
    line = (f"L1 is not qualified for {key.platform} {key.profile} (phase {', '.join(missing)}): a replication "
            f"fault there restarts the job (L2) instead of repairing in process")
    if siblings:
        line += (f"; {', '.join(siblings)} is qualified, but a patch release is not assumed to behave as its "
                 f"sibling (it may move the private state the repair rebinds)")
    return line + ". Earn L1 here with: accelpact-qualify JOB.yaml --phase all (a few minutes, real trials)"


def profile_key(device: str, nodes: int, ranks_per_node: int, fsdp: str, mesh: str) -> str:
    return f"{device}:{nodes}x{ranks_per_node}:{fsdp}-{mesh}"


#: Phases whose faults L1 may repair when the envelope qualifies the key.
QUALIFIABLE_PHASES = ("committed", "backward")


def decide(envelope: Envelope, key: Key, min_trials: int = MIN_TRIALS) -> tuple[str, str]:
    """Preserve only where the key is qualified; everything else is Restart.

    Two phases can be qualified: ``committed`` (a fault at the guard's own collective) and ``backward``
    (a replication fault during backward: the update is discarded and run again).  Any other phase
    (forward, the optimizer step) is Restart.
    """
    if key.phase not in QUALIFIABLE_PHASES:
        return RESTART, f"fault in uncommitted compute (phase {key.phase}): only a restart is safe"
    entry = envelope.find(key)
    if entry is None:
        return RESTART, f"no envelope entry for {key}: unqualified, restart"
    if PRESERVE not in entry.actions:
        return RESTART, f"envelope entry for {key} does not qualify preserve"
    trials = int(entry.evidence.get("trials", 0))
    ok = int(entry.evidence.get("successes", 0))
    if trials < min_trials or ok < trials:
        return RESTART, f"envelope entry for {key} has {ok}/{trials} successful trials (need {min_trials}/{min_trials})"
    return PRESERVE, f"qualified by {ok}/{trials} trials on {entry.evidence.get('date', '?')}"


def trial_envelope(key: Key) -> Envelope:
    """The envelope a qualification trial runs under: Preserve is attempted for ``key`` only."""
    return Envelope([Entry(key, (PRESERVE,), {"trials": MIN_TRIALS, "successes": MIN_TRIALS, "date": "trial"})])


def user_path(environ: Mapping[str, str] | None = None) -> str:
    """The user's envelope file: ``$XDG_CONFIG_HOME/accelpact/envelope.yaml``, else
    ``~/.config/accelpact/envelope.yaml``.

    A relative ``XDG_CONFIG_HOME`` is ignored, as the XDG base directory specification asks.
    """
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(base):
        home = environ.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".config")
    return os.path.join(base, USER_FILE)


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> Envelope:
    """The envelope a lookup uses.

    ``path`` given (``ACCELPACT_ENVELOPE``, ``accelpact-qualify --envelope``): that file alone.  Otherwise
    the user's file (:func:`user_path` of ``environ``) layered over :data:`SHIPPED`: for a key both hold
    the user's entry wins, so a qualification earned (or failed) on this platform decides the user's next
    job.  A missing file holds no entries; a malformed one is a :class:`ConfigError` naming it.
    """
    if path:
        return load_file(path)
    shipped = load_file(SHIPPED)
    user = load_file(user_path(environ))
    if not user.entries:
        return shipped
    layered = Envelope(list(shipped.entries), user.path)
    for entry in user.entries:
        layered.upsert(entry)
    return layered


def load_file(path: str) -> Envelope:
    """The entries of one envelope file (none when it does not exist)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        return Envelope([], path)
    except OSError as exc:
        raise ConfigError("envelope", path, f"cannot read it ({exc.strerror or exc}); fix its permissions or "
                                            f"name another file") from None
    except yaml.YAMLError as exc:
        raise ConfigError("envelope", path, f"malformed YAML ({exc.__class__.__name__}); fix or delete the file") from None
    if not isinstance(data, dict):
        raise ConfigError("envelope", path, f"holds a {type(data).__name__}, not a mapping with 'entries'; "
                                            f"fix or delete the file")
    entries = []
    for i, raw in enumerate(data.get("entries") or []):
        try:
            k = raw["key"]
            key = Key(str(k["platform"]), str(k["profile"]), str(k["phase"]), str(k.get("objective", DEFAULT_OBJECTIVE)))
            actions = tuple(str(a) for a in raw.get("actions", ()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"envelope.entries[{i}]", raw, f"needs key.platform/profile/phase and actions ({exc}); "
                                                             f"fix {path}") from None
        for a in actions:
            if a not in ACTIONS:
                raise ConfigError(f"envelope.entries[{i}].actions", a, f"must be one of {', '.join(ACTIONS)} ({path})")
        entries.append(Entry(key, actions, dict(raw.get("evidence") or {})))
    return Envelope(entries, path)


def save(envelope: Envelope, path: str) -> None:
    """Write ``envelope`` to ``path`` atomically (a reader sees the old file or the new one), creating its folder."""
    data = {"entries": [e.as_dict() for e in envelope.entries]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("# Recovery actions qualified per observation key <platform, profile, phase, objective>.\n"
                 "# Written by accelpact-qualify from real fault-and-repair trials; no entry means Restart.\n")
        yaml.safe_dump(data, fh, sort_keys=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def today() -> str:
    return _dt.date.today().isoformat()
