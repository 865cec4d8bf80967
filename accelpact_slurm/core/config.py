"""Job configuration: frozen keyword-only dataclasses built from a YAML job file.

One function, :func:`load_config`, turns YAML into a :class:`JobConfig`; every problem (malformed YAML, an unknown
key, a wrong type, an impossible value, inconsistent timeouts) raises
:class:`~accelpact_slurm.core.errors.ConfigError` whose one-line message names the field, the value and the fix.

Precedence is flag > environment > file > default; flags and environment are applied by the caller through
:func:`with_overrides` so that this module stays pure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from accelpact_slurm.core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
#: ``boundary``/``backward``: the rank leaves the replication collective (withholds its part); ``-stuck``: it stays
#: in the collective but its part never arrives (a stalled link: every member waits inside it).
FAULT_PHASES = ("boundary", "forward", "backward", "backward-all", "boundary-stuck", "backward-stuck")
ENTRY_RE = re.compile(r"^([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$")


@dataclass(frozen=True, kw_only=True)
class TopologyConfig:
    """Embedded-default topology; inside Slurm the allocation's sizes win."""

    nodes: int = 2
    ranks_per_node: int = 2
    threads_per_rank: int = 1  # torch.set_num_threads on every rank (the embedded default shares one machine)
    device: str = "auto"  # auto (a GPU per rank when the allocation gives one, else the CPU) | cpu | cuda
    #: Warm spare nodes beside the training nodes, each with ``ranks_per_node`` parked processes (0: none, the
    #: default, costs nothing); ``core.spares`` documents what a spare does.
    spare_nodes: int = 0


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 0
    keep_last: int = 2
    milestone_every: int = 0
    compress: bool = False
    at_end: bool = True  # a verified snapshot of the last update before the job reports it completed
    local_dir: str | None = None
    shared_dir: str | None = None
    shared_every: int = 2  # every K-th snapshot also goes to the shared tier, once per job (0: milestones only)
    shared_keep: int = 2  # non-milestone copies the shared tier keeps (the newest verified ones)
    daemon_nice: int = 10  # the node daemon's CPU niceness: its writes yield to training on a busy CPU


@dataclass(frozen=True, kw_only=True)
class TimeoutConfig:
    """Seconds.  ``collective_s`` is the ceiling of a data-plane collective (the backend's own timeout); it must
    be shorter than ``control_s`` (the control-plane and repair deadline), or a repair times out while its peers
    are still detecting the fault.

    The fault detector (``docs/detection.md``) decides before those ceilings: every rank publishes a heartbeat
    every ``heartbeat_interval_s``; a rank whose heartbeat stops for ``heartbeat_s`` while its process lives is
    hung; a collective every member is alive and waiting in for longer than a bound learned from the job's own
    collectives (at least ``link_floor_s``) is a broken link."""

    collective_s: float = 5.0
    control_s: float = 30.0
    startup_s: float = 120.0
    shutdown_s: float = 10.0
    heartbeat_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    link_floor_s: float = 0.5


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """L2: how many starts without progress before giving up, and the embedded default's relaunch budget."""

    max_stalled_restarts: int = 3
    max_restarts: int = 20


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """``PHASE:STEP:RANK[:always]``: make RANK withhold its part of the replication
    collective in PHASE of update STEP (``boundary``: right after update STEP).

    A fault fires on the job's first start only (a restart replays the update and must get past it); ``:always`` makes
    it fire on every start (a fault that recurs, as a broken node would)."""

    phase: str
    step: int
    rank: int
    always: bool = False

    @classmethod
    def parse(cls, text: str, field_name: str = "faults") -> "FaultSpec":
        parts = str(text).split(":")
        always = len(parts) == 4 and parts[3] == "always"
        if len(parts) == 4 and not always:
            raise ConfigError(field_name, text, "the optional 4th field must be 'always', e.g. backward:3:1:always")
        if len(parts) not in (3, 4):
            raise ConfigError(field_name, text, "write a fault as PHASE:STEP:RANK, e.g. boundary:15:1")
        phase, step, rank = parts[:3]
        if phase not in FAULT_PHASES:
            raise ConfigError(field_name, text, f"PHASE must be one of {', '.join(FAULT_PHASES)}")
        try:
            step_i, rank_i = int(step), int(rank)
        except ValueError:
            raise ConfigError(field_name, text, "STEP and RANK must be integers, e.g. boundary:15:1") from None
        if step_i < 1 or rank_i < 0:
            raise ConfigError(field_name, text, "STEP must be >= 1 and RANK >= 0")
        return cls(phase=phase, step=step_i, rank=rank_i, always=always)

    def __str__(self) -> str:
        return f"{self.phase}:{self.step}:{self.rank}" + (":always" if self.always else "")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The project's own sections; ``params`` is the user's, handed to the entry point untouched."""

    name: str = "job"
    entry: str = ""  # module:function, called with the Job on every rank
    seed: int = 0
    steps: int = 25
    log_every: int = 5
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    faults: tuple[FaultSpec, ...] = ()
    params: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.topology.nodes * self.topology.ranks_per_node

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["faults"] = [str(f) for f in self.faults]
        return out

    def digest(self) -> str:
        """SHA-256 of the effective configuration (stable key order)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str]) -> JobConfig:
    """Read and validate a YAML job file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError("config", path, f"cannot read the job file ({exc.strerror}); pass an existing YAML file") from exc
    except UnicodeDecodeError as exc:  # a UTF-16 or binary file: a traceback from the codec otherwise
        raise ConfigError("config", path, f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                                          f"{exc.start}); save the job file as UTF-8") from None
    return parse_config(text, source=path)


def read_mapping(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The job file's top level as written (which keys it sets); ``{}`` when it is not a mapping.

    Raises:
        ConfigError: the file cannot be read or parsed (as :func:`load_config` says it).
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError):
        load_config(path)  # raises the one-line error
        raise
    data = _load_yaml(text, path)
    return data if isinstance(data, Mapping) else {}


def parse_config(text: str, source: str = "<string>") -> JobConfig:
    data = _load_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("config", type(data).__name__, f"the top level of {source} must be a mapping of sections")
    cfg = _build(JobConfig, data, "")
    validate(cfg)
    return cfg


class _AliasRefused(Exception):
    """Raised by :class:`_NoAliasLoader` at the first alias, with where it is."""

    def __init__(self, anchor: str, mark: Any) -> None:
        super().__init__(anchor)
        self.anchor = anchor
        self.mark = mark


class _NoAliasLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses aliases (``*name``, also in ``<<: *name`` merge keys).

    A few hundred bytes of nested aliases (the "billion laughs") expand to gigabytes as soon as anything walks the
    value: an error message, the job_start event, the digest.  A job file has no need for them.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(event.anchor, event.start_mark)
        return super().compose_node(parent, index)


def _load_yaml(text: str, source: str) -> Any:
    """The job file's YAML as plain data; every way it can fail becomes one :class:`ConfigError` line."""
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    except _AliasRefused as exc:
        raise ConfigError("config", source, f"YAML alias *{exc.anchor} at line {exc.mark.line + 1}, column "
                                            f"{exc.mark.column + 1}: job files may not use aliases (a few of them "
                                            f"can expand to gigabytes); write the value out in full") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("config", source, f"malformed YAML at {where}: {problem}; fix the syntax there") from None
    except RecursionError:  # PyYAML recurses once per nesting level: thousands of [ or { exhaust the stack
        raise ConfigError("config", source, "nested too deeply for a job file; flatten it") from None
    except ValueError as exc:  # raised from inside PyYAML: int() of 4300+ digits, a date like 2024-13-45
        reason = str(exc).split(";")[0][:120]
        raise ConfigError("config", source, f"a value YAML cannot convert ({reason}); fix it or quote it") from None
    finally:
        loader.dispose()


def from_dict(data: Mapping[str, Any]) -> JobConfig:
    cfg = _build(JobConfig, data, "")
    validate(cfg)
    return cfg


def with_overrides(cfg: JobConfig, overrides: Mapping[str, Any]) -> JobConfig:
    """Return ``cfg`` with dotted-key overrides (``{"steps": 10, "topology.nodes": 1}``) applied and validated."""
    data = cfg.to_dict()
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(dotted, value, "no such configuration section")
            node = node[part]
        if parts[-1] not in node:
            raise ConfigError(dotted, value, "no such configuration key")
        node[parts[-1]] = value
    return from_dict(data)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}{key}"
            raise ConfigError(where, data[key], f"unknown key; known keys here: {', '.join(sorted(names))}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{prefix}{f.name}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if value is None:
            return hint()
        if not isinstance(value, Mapping):
            raise ConfigError(where, value, "must be a mapping (a YAML section)")
        return _build(hint, value, f"{where}.")
    if origin is tuple and typing.get_args(hint)[:1] == (FaultSpec,):
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(where, value, "must be a list of PHASE:STEP:RANK strings")
        return tuple(FaultSpec.parse(v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is dict:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(where, value, "must be a mapping (a YAML section of your own keys)")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(where, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, value, "must be an integer")
        return value
    if hint is float:
        return _finite_float(value, where)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(where, value, "must be a string")
        return value
    raise ConfigError(where, value, f"unsupported type {hint}")  # pragma: no cover


def _finite_float(value: Any, where: str) -> float:
    """``value`` as a finite float, else a :class:`ConfigError` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, value, "must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        raise ConfigError(where, value, "must be a finite number") from None
    # YAML's .nan passes every `<= 0` and `>=` check below, and .inf a deadline check: each crashes every rank.
    if not math.isfinite(number):
        raise ConfigError(where, value, "must be a finite number (.nan and .inf are not allowed)")
    return number


# --------------------------------------------------------------------------- validation


def check_timeouts(t: TimeoutConfig) -> tuple[bool, str]:
    """Pure check of the timeout relation; returns ``(ok, reason)``."""
    if t.collective_s >= t.control_s:
        return False, (
            f"must be shorter than timeouts.control_s ({t.control_s:g}): the control plane must outlive "
            f"fault detection on the data plane; lower collective_s or raise control_s above collective_s "
            f"plus the detection skew between ranks"
        )
    return True, "collective timeout is shorter than the control-plane timeout"


def check_detector(t: TimeoutConfig) -> tuple[bool, str, str]:
    """Pure check of the detector's settings; returns ``(ok, field, reason)``."""
    if t.heartbeat_interval_s * 4 > t.heartbeat_s:
        return False, "heartbeat_interval_s", (
            f"must be at most a quarter of timeouts.heartbeat_s ({t.heartbeat_s:g}): a rank is called hung after "
            f"heartbeat_s without a heartbeat, so a few must fit in it; lower heartbeat_interval_s or raise "
            f"heartbeat_s")
    if t.link_floor_s >= t.collective_s:
        return False, "link_floor_s", (
            f"must be shorter than timeouts.collective_s ({t.collective_s:g}), the ceiling of a collective: "
            f"the detector decides between the two")
    return True, "", "detector settings consistent"


def validate(cfg: JobConfig) -> None:
    def positive(where: str, value: float, fix: str = "must be > 0") -> None:
        if value <= 0:
            raise ConfigError(where, value, fix)

    if cfg.steps < 0:
        raise ConfigError("steps", cfg.steps, "must be >= 0 (the number of optimizer updates to run)")
    positive("topology.nodes", cfg.topology.nodes, "must be >= 1")
    positive("topology.ranks_per_node", cfg.topology.ranks_per_node, "must be >= 1")
    positive("log_every", cfg.log_every, "must be >= 1 (updates between progress lines)")
    positive("topology.threads_per_rank", cfg.topology.threads_per_rank, "must be >= 1")
    if cfg.topology.spare_nodes < 0:
        raise ConfigError("topology.spare_nodes", cfg.topology.spare_nodes,
                          "must be >= 0 (warm spare nodes beside the training nodes; 0: none)")
    if cfg.topology.device not in DEVICES:
        raise ConfigError("topology.device", cfg.topology.device,
                          f"must be one of {', '.join(DEVICES)} (auto: a GPU per rank when the allocation has one)")
    if cfg.entry and not ENTRY_RE.match(cfg.entry):
        raise ConfigError("entry", cfg.entry, "write the entry point as module:function or path/to/file.py:function, e.g. train:main")
    c = cfg.checkpoint
    if c.every_steps < 0:
        raise ConfigError("checkpoint.every_steps", c.every_steps, "must be >= 0 (0 turns snapshots off)")
    if c.keep_last < 2:
        raise ConfigError(
            "checkpoint.keep_last", c.keep_last,
            "must be >= 2: with one kept snapshot a crash while writing the next leaves nothing verified to resume from",
        )
    if c.milestone_every < 0:
        raise ConfigError("checkpoint.milestone_every", c.milestone_every, "must be >= 0 (0: no milestones)")
    if c.shared_every < 0:
        raise ConfigError("checkpoint.shared_every", c.shared_every,
                          "must be >= 0 (every K-th snapshot goes to the shared tier; 0: only milestones)")
    if c.shared_keep < 1:
        raise ConfigError("checkpoint.shared_keep", c.shared_keep,
                          "must be >= 1: the shared tier is what a node that lost its disk resumes from, so it "
                          "keeps at least its newest verified copy")
    if not 0 <= c.daemon_nice <= 19:
        raise ConfigError("checkpoint.daemon_nice", c.daemon_nice,
                          "must be a niceness from 0 (same CPU priority as training) to 19 (lowest)")
    to = cfg.timeouts
    for name in ("collective_s", "control_s", "startup_s", "shutdown_s", "heartbeat_s", "heartbeat_interval_s",
                 "link_floor_s"):
        positive(f"timeouts.{name}", getattr(to, name), "must be a positive number of seconds")
    ok, reason = check_timeouts(to)
    if not ok:
        raise ConfigError("timeouts.collective_s", to.collective_s, reason)
    ok, where, reason = check_detector(to)
    if not ok:
        raise ConfigError(f"timeouts.{where}", getattr(to, where), reason)
    if cfg.recovery.max_stalled_restarts < 1:
        raise ConfigError("recovery.max_stalled_restarts", cfg.recovery.max_stalled_restarts,
                          "must be >= 1 (restarts allowed without progress before the job stops for good)")
    if cfg.recovery.max_restarts < 0:
        raise ConfigError("recovery.max_restarts", cfg.recovery.max_restarts, "must be >= 0")
    for i, f in enumerate(cfg.faults):
        if f.step > cfg.steps:
            raise ConfigError(f"faults[{i}]", str(f), f"STEP must be <= steps ({cfg.steps})")
        if f.rank >= cfg.world_size:
            raise ConfigError(f"faults[{i}]", str(f), f"RANK must be < the world size ({cfg.world_size})")


# --------------------------------------------------------------------------- what the defaults mean at a start


def snapshot_note(cfg: JobConfig) -> str | None:
    """The start-up warning of a job that takes no snapshots (``checkpoint.every_steps`` 0, the default), else None.

    Snapshots off is a deliberate default (a job file asks for them, and for their cadence): the warning says
    what it costs, so that nobody learns it at the first restart.
    """
    if cfg.checkpoint.every_steps > 0 or cfg.steps == 0:
        return None
    return (f"no snapshots are taken (checkpoint.every_steps is 0, the default): a restart (L2: a fault L1 does "
            f"not repair, a preemption, a requeue) starts again from update 1 and redoes every update, up to all "
            f"{cfg.steps}; set checkpoint.every_steps: N in the job file to snapshot every N updates "
            f"(accelpact-cadence recommends N)")


def relaunch_resumes(every_steps: int) -> str:
    """What a relaunch does, in the words a launcher prints after "relaunching the job (restart K); "."""
    if every_steps > 0:
        return "it reloads the newest verified snapshot"
    return ("it starts again from update 1 unless an earlier start left a verified snapshot (checkpoint.every_steps "
            "is 0: this job takes none)")


# --------------------------------------------------------------------------- the training-relevant part

#: The keys whose change makes a run directory's snapshots another training's (the rest: where, how often,
#: how long to wait, which faults to inject).
TRAINING_KEYS = ("entry", "seed", "steps", "params")


def training_part(cfg: JobConfig) -> dict[str, Any]:
    """The training-relevant part of ``cfg`` (JSON-able), as a run directory records it at its first start."""
    data = cfg.to_dict()
    return {k: data[k] for k in TRAINING_KEYS}


def training_diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys where two training parts differ (pure)."""
    out: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += training_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


_ABSENT = object()
