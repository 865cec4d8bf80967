"""The one harness every benchmark part shares (``benchmarks/parts/*.py``, ``benchmarks/parts/paper.py``,
``benchmarks/harness/run.py``; ``scripts/gpu_check.py`` uses its statistics).

Contract of a benchmark part (so ``make bench`` can run it and regenerate ``docs/benchmarks.md``):

- ``main(argv)`` accepts ``--json PATH`` (write the result there) and ``--markdown FILE`` (``''`` = do not
  touch any markdown), and ``--render JSON`` (only re-render the block of an earlier result);
- ``markdown(res) -> str`` renders the part's block *including* its two ``MARK`` lines from the JSON alone;
- ``res`` carries ``"part"``, ``"date"``, ``"machine"`` (``machine()``) and ``"rows"``: a list of
  ``{"what", "baseline", "ratio", "spread", "n", ...}`` summary rows (median ratio, "min–max" spread) that
  the overview table of ``docs/benchmarks.md`` shows (``row()``).

Every figure is a ratio against a baseline measured in the same run, side by side (this machine is shared
and noisy): ``abba``/``rotate`` order the paired runs, ``paired_ratios``/``ratio_stats``/``spread`` reduce
them to median (min–max); absolute times are printed beside them and never compared across runs.

Ranks are launched by the library's own launcher (``accelpact_slurm.launch.local.launch_local``: emulated
Slurm environment, free ports, per-node checkpoint daemons, supervision) through ``launch_job``; the part's
code enters each rank the way a user's does: the job file's ``entry:`` names the part's entry point
(``benchmarks/parts/<part>_entry.py:main``, written by ``benchmarks.parts.workload.write_job``), and its plan travels in
the job file's ``params.bench`` (``job.params``).

Only the standard library is imported at module level: the GPU check imports this on a machine that has
nothing but torch, and ``bench_all.py`` imports it to render the docs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[2]
DEADLINE_VAR = "ACCELPACT_BENCH_DEADLINE_S"  # set by bench_all.py: the part's hard deadline


def add_paths() -> None:
    """The repository (the library and the ``benchmarks`` package) on ``sys.path``."""
    for p in (str(REPO),):
        if p not in sys.path:
            sys.path.insert(0, p)


# ====================================================================== command-line conventions


def today() -> str:
    return _dt.date.today().isoformat()


def output_args(ap: argparse.ArgumentParser, json_default: str | None, json_help: str = "") -> None:
    """``--json PATH``, ``--markdown FILE`` and ``--render JSON``, the same in every part.

    Relative paths are taken from the repository root (``out_path``), where ``make bench`` runs the parts.
    """
    ap.add_argument("--json", metavar="PATH", default=json_default,
                    help=json_help or "where the result goes (default: %(default)s)")
    ap.add_argument("--markdown", metavar="FILE", default="",
                    help="a file whose block of this part is rewritten (default '': none; docs/benchmarks.md is "
                         "rendered from the committed summaries by benchmarks/harness/run.py)")
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown block from an earlier result file")


def out_path(p: str | os.PathLike[str]) -> Path:
    p = Path(p)
    return p if p.is_absolute() else REPO / p


def json_field(p: str | os.PathLike[str]) -> str:
    """How a result names its own file: relative to the repository when inside it."""
    p = out_path(p)
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def outer_deadline(default_s: float, margin_s: float, floor_s: float = 0.0) -> float:
    """``default_s``, lowered to ``$ACCELPACT_BENCH_DEADLINE_S - margin_s`` (not under ``floor_s``) when set."""
    outer = os.environ.get(DEADLINE_VAR)
    return default_s if not outer else min(default_s, max(floor_s, float(outer) - margin_s))


def stop_on_signals(tag: str, sigs: Sequence[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """SIGTERM (bench_all's deadline) and SIGINT unwind as ``SystemExit``, so ``finally`` blocks clean up."""

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(f"[{tag}] stopped by signal {signal.Signals(signum).name}")

    for s in sigs:
        signal.signal(s, on_signal)


def logger(tag: str, t0: float | None = None) -> Callable[[str], None]:
    """``log(msg)`` printing ``[tag] msg`` (``[tag mm:ss] msg`` with a start time), flushed."""

    def log(msg: str) -> None:
        if t0 is None:
            print(f"[{tag}] {msg}", flush=True)
        else:
            el = time.monotonic() - t0
            print(f"[{tag} {int(el // 60):02d}:{int(el % 60):02d}] {msg}", flush=True)

    return log


# ====================================================================== the machine: benchmarks/harness/env.py

from benchmarks.harness.env import fs_type, machine, machine_line  # noqa: E402,F401  (the parts call them as h.machine())


# ====================================================================== statistics and timing: benchmarks/harness/stats.py

from benchmarks.harness.stats import (  # noqa: E402,F401  (the parts call them as h.med(), h.Budget, ...)
    Budget, abba, fmt, fmt_spread, mean, med, paired_ratios, ratio, ratio_stats, rotate, row, spread)


# ====================================================================== results


def new_result(part: str, **fields: Any) -> dict[str, Any]:
    """A part's result: its name, today's date and the machine, then ``fields``."""
    return {"part": part, "date": today(), "machine": machine(), **fields}


def finish(res: dict[str, Any]) -> dict[str, Any]:
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    return res


def write_result(res: dict[str, Any], path: str | os.PathLike[str], failed: bool = False) -> Path:
    """The result as JSON (a failed run goes beside the last good one: ``<name>-failed.json``)."""
    out = out_path(path)
    if failed:
        out = out.with_name(out.stem + "-failed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    tmp.replace(out)
    return out


def read_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_block(path: Path, mark: str, block: str) -> None:
    """Replace the text between the two ``mark`` lines of ``path`` with ``block`` (append when absent)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if text.count(mark) >= 2:
        a = text.index(mark)
        b = text.index(mark, a + len(mark)) + len(mark)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_markdown(target: str | None, mark: str, block: str) -> Path | None:
    """``write_block`` into ``--markdown`` (nothing for ``''``)."""
    if not target:
        return None
    path = out_path(target)
    write_block(path, mark, block)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


class EventTail:
    """One rank's new records in a job's event log (``events.jsonl``), read from where the last read ended, whole
    lines only: what the product emits (``repair_rank``, ``fault``, ``snapshot``, ...) is what a part times."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank, self.offset = path, rank, 0

    def skip(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("rank") == self.rank:
                out.append(rec)
        return out


def tail(path: Path, n: int = 40, sep: str = "\n", limit: int | None = None) -> str:
    try:
        text = sep.join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return "(no log)"
    return text[-limit:] if limit else text


# ====================================================================== launching ranks


def free_ports(n: int = 1, consecutive: bool = False) -> list[int]:
    """``n`` distinct free loopback ports (the library's ``free_port``); ``consecutive``: a block of ``n``."""
    import socket

    from accelpact_slurm.launch.local import free_port

    for _ in range(200):
        base = free_port()
        if not consecutive:
            ports = [base]
            while len(ports) < n:
                p = free_port()
                if p not in ports:
                    ports.append(p)
            return ports
        try:
            for port in range(base + 1, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return list(range(base, base + n))
    raise OSError("no free port block")


def bench_environ(extra: Mapping[str, str] | None = None, scrub: Iterable[str] = ()) -> dict[str, str]:
    """This environment for a part's ranks: no Slurm variables of the caller (the ranks get emulated ones),
    none starting with one of ``scrub``, the repository first on ``PYTHONPATH`` (the
    entry points import ``bench.*``), then ``extra``."""
    drop = ("SLURM", *scrub)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    paths = [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


_RANK_LABEL = re.compile(r"^ *\d+: ")


class LineFilter:
    """A text stream for rank 0's echo that passes only the lines starting with one of ``prefixes`` (after the
    rank label the launcher puts before each, ``0: ``)."""

    def __init__(self, prefixes: Sequence[str], stream: TextIO | None = None) -> None:
        self.prefixes, self.stream, self.buf = tuple(prefixes), stream or sys.stdout, ""

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            line = _RANK_LABEL.sub("", line, count=1)
            if line.startswith(self.prefixes):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def launch_job(config: str | os.PathLike[str], run_dir: str | os.PathLike[str],
               extra_env: Mapping[str, str] | None = None, scrub: Iterable[str] = (), echo: TextIO | None = None,
               job_id: str | None = None) -> int:
    """One start of a job's ranks on the embedded default, exactly as ``accelpact-run`` starts them.

    ``accelpact_slurm.launch.local.launch_local`` (emulated Slurm environment per rank, free rendezvous
    ports, the per-node checkpoint daemons when the job file snapshots, supervision, logs under
    ``RUN_DIR/logs/``); each rank runs ``accelpact_slurm.cli.worker``, which calls the job file's ``entry``
    (a part's entry point reads its plan from ``job.params["bench"]``).  Returns the job's exit code
    (``combine_exit_codes``).
    """
    from accelpact_slurm.core.config import load_config
    from accelpact_slurm.launch.local import launch_local

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(config)
    return launch_local(str(config), cfg, str(run_dir), environ=bench_environ(extra_env, scrub),
                        out=echo or sys.stdout, job_id=job_id or f"bench-{os.getpid()}")


def failed_ranks(run_dir: Path, world: int, done: Callable[[int], Path]) -> str:
    """The ranks that left no ``done(rank)`` file (else rank 0), each with the end of its log (two at most)."""
    missing = [r for r in range(world) if not done(r).exists()] or [0]
    return "\n".join(f"rank {r}'s log ends:\n{tail(run_dir / 'logs' / f'rank-{r}.log', 25)}" for r in missing[:2])


# ---------------------------------------------------------------------- rank side


def guard_rank(deadline_s: float | None) -> None:
    """A rank exits by itself (code 3) after ``deadline_s`` or as soon as its launcher is gone."""
    parent, t0 = os.getppid(), time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent or (deadline_s is not None and time.monotonic() - t0 > deadline_s):
                os._exit(3)

    threading.Thread(target=watch, name="bench-rank-guard", daemon=True).start()
