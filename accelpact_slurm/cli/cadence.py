"""``accelpact-cadence``: the checkpoint interval that maximises goodput, from failure logs.

Usage::

    accelpact-cadence --sacct sacct.txt --jobcomp jobcomp.log --events runs/*/events.jsonl
    accelpact-cadence --events runs/123 --checkpoint-cost-s 4 --json
    accelpact-cadence --sacct sacct.txt --step-time-s 2 --checkpoint-cost-s 4 --write job.yaml

Costs not given as flags are measured from the event logs; the source of every
number is printed (and is in ``--json``).  Exit status: 0; 2 for bad usage or when
a needed cost is neither given nor measured (what could be computed is still printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tempfile
from typing import Any, Sequence

from accelpact_slurm.ops import cadence as cd
from accelpact_slurm.ops import failure_logs as fl
from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_USAGE, ConfigError
from accelpact_slurm.core.events import BadLine, finite
from accelpact_slurm.ops.cadence_analysis import (DEFAULT_GUARD_OVERHEAD, DEFAULT_REJECTION_S, DEFAULT_REPAIR_S,
                                                   analyse)
from accelpact_slurm.ops.termchart import line_chart

log = logging.getLogger(__name__)
_LABELS = {fl.COMM_COMMITTED: "comm fault, committed (L1-eligible)", fl.UNCOMMITTED: "fault in uncommitted compute",
           fl.NODE_FAIL: "node failure", fl.PREEMPTED: "preemption", fl.TIMEOUT: "timeout", fl.OTHER: "other failure"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accelpact-cadence",
                                description="Checkpoint interval and L1 savings from Slurm failure logs and event logs.",
                                epilog="documentation: docs/operator-tools.md#accelpact-cadence")
    p.add_argument("--sacct", action="append", default=[], metavar="FILE",
                   help="sacct -P -D -X -o JobID,State,ExitCode,Start,End,NodeList,Elapsed output (repeatable)")
    p.add_argument("--jobcomp", action="append", default=[], metavar="FILE", help="jobcomp/filetxt log (repeatable)")
    p.add_argument("--events", action="extend", nargs="+", default=[], metavar="FILE",
                   help="events.jsonl files or run directories")
    p.add_argument("--step-time-s", type=float, metavar="T", help="seconds per optimizer step")
    p.add_argument("--checkpoint-cost-s", type=float, metavar="D", help="seconds training is blocked per snapshot")
    p.add_argument("--restart-cost-s", type=float, metavar="R", help="seconds from a failure to computing again")
    p.add_argument("--guard-overhead", type=float, metavar="H",
                   help=f"fractional slowdown of the boundary guard (default {DEFAULT_GUARD_OVERHEAD})")
    p.add_argument("--repair-s", type=float, help=f"seconds per L1 repair (default: measured, else {DEFAULT_REPAIR_S})")
    p.add_argument("--rejection-s", type=float,
                   help=f"seconds to detect and reject an uncommitted fault (default: measured, else {DEFAULT_REJECTION_S})")
    p.add_argument("--age-steps", type=float, metavar="A",
                   help="checkpoint age at a fault, in steps (default: measured, else half the interval)")
    p.add_argument("--observed-s", type=float, help="observed time in seconds (default: sum of the runs' durations)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the rate intervals (default 0.95)")
    p.add_argument("--max-regret", type=float, default=cd.MAX_REGRET, metavar="FRACTION",
                   help="recommend only when, anywhere in the rate's confidence interval, the interval recommended "
                        f"costs at most this much goodput against the best one (default {cd.MAX_REGRET:g}); with "
                        "less observed time nothing is recommended and --write writes nothing")
    p.add_argument("--json", action="store_true", help="print the accelpact-cadence/1 JSON document")
    p.add_argument("--plot", metavar="PNG", help="draw goodput against interval to PNG (needs matplotlib)")
    p.add_argument("--write", metavar="CONFIG", help="set checkpoint.every_steps in this job file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), format="%(name)s: %(message)s")
    if not (args.sacct or args.jobcomp or args.events):
        print("accelpact-cadence: give at least one of --sacct, --jobcomp, --events", file=sys.stderr)
        return EXIT_USAGE
    if not 0 < args.confidence < 1:
        print("accelpact-cadence: --confidence must be in (0, 1)", file=sys.stderr)
        return EXIT_USAGE
    if not 0 < args.max_regret < 1:
        print("accelpact-cadence: --max-regret must be in (0, 1), e.g. 0.01 for 1 % goodput", file=sys.stderr)
        return EXIT_USAGE
    for flag in ("step_time_s", "observed_s"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            print(f"accelpact-cadence: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return EXIT_USAGE
    for flag in ("checkpoint_cost_s", "restart_cost_s", "guard_overhead", "repair_s", "rejection_s", "age_steps"):
        value = getattr(args, flag)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            print(f"accelpact-cadence: --{flag.replace('_', '-')} must be a finite number >= 0", file=sys.stderr)
            return EXIT_USAGE
    doc = analyse(args)
    rc = 0 if not doc["missing"] else EXIT_USAGE
    if args.write and doc["missing"] == [] and doc["recommendation"]["every_steps"] is not None:
        try:
            doc["write"] = write_every_steps(args.write, doc["recommendation"]["every_steps"])
        except (OSError, ConfigError) as exc:
            doc["write"] = {"path": args.write, "error": str(exc)}
            rc = EXIT_USAGE
    elif args.write:
        proof = doc["recommendation"].get("evidence") or {}
        why = "not enough observed time" if proof.get("enough") is False else \
            "missing input" if doc["missing"] else "no recommendation in steps"
        doc["write"] = {"path": args.write, "error": f"{why}: nothing written"}
        rc = EXIT_USAGE
    if args.json:
        print(json.dumps(_finite(doc), sort_keys=True, indent=1))
    else:
        print(render(doc))
    if args.plot and doc["goodput"]["curve"]:
        err = plot_png(args.plot, doc)
        if err:
            print(f"accelpact-cadence: {err}", file=sys.stderr)
            rc = EXIT_USAGE
    if args.json:  # stdout holds the document; people still see what was skipped
        for b in doc["bad_lines"]:
            print(f"accelpact-cadence: {_bad_line(b)}", file=sys.stderr)
    return rc


def _bad_line(b: dict[str, Any]) -> str:
    """One skipped line or file of the document, as :class:`BadLine` prints it (line 0: the whole file)."""
    return str(BadLine(b["path"], b["lineno"], b["reason"]))


# --------------------------------------------------------------------------- job file


def set_every_steps(text: str, steps: int) -> tuple[str, int | None]:
    """Set ``every_steps`` inside the ``checkpoint:`` mapping by editing one line; returns (text, old value).

    Comments, blank lines and every other line are kept byte for byte.  Adds the key (or the whole mapping) when
    absent.  Flow style (``checkpoint: {...}``) is refused rather than rewritten.
    """
    lines = text.splitlines(keepends=True)
    nl = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    head = next((i for i, l in enumerate(lines) if re.match(r"^checkpoint\s*:", l)), None)
    if head is None:
        sep = "" if not text or text.endswith("\n") else nl
        return f"{text}{sep}checkpoint:{nl}  every_steps: {steps}{nl}", None
    if re.match(r"^checkpoint\s*:\s*[^\s#]", lines[head]):
        raise ConfigError("checkpoint", lines[head].strip(), "write the checkpoint mapping in block style to use --write")
    indent = None
    for i in range(head + 1, len(lines)):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cur = len(line) - len(line.lstrip(" "))
        if cur == 0:
            break
        indent = cur if indent is None else indent
        m = re.match(r"^(\s*every_steps\s*:\s*)([^\s#]*)(.*)$", line.rstrip("\r\n"))
        if m and cur == indent:
            old = m.group(2)
            lines[i] = f"{m.group(1)}{steps}{m.group(3)}{nl}"
            return "".join(lines), int(old) if re.fullmatch(r"-?\d+", old) else None
    pad = " " * (indent or 2)
    lines.insert(head + 1, f"{pad}every_steps: {steps}{nl}")
    return "".join(lines), None


def write_every_steps(path: str, steps: int) -> dict[str, Any]:
    """Apply :func:`set_every_steps` to a file atomically (temp file + rename, mode kept)."""
    with open(path, encoding="utf-8", newline="") as fh:
        text = fh.read()
    new, old = set_every_steps(text, steps)
    milestone = re.search(r"^\s+milestone_every\s*:\s*(\d+)", new, re.M)
    warning = None
    if milestone and int(milestone.group(1)) and int(milestone.group(1)) % steps:
        warning = f"milestone_every {milestone.group(1)} is not a multiple of every_steps {steps}"
    if new != text:
        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".cadence-", dir=d)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
                fh.write(new)
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            os.replace(tmp, path)  # a crash mid-write must not leave a half job file
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return {"path": path, "old": old, "new": steps, "changed": new != text, "warning": warning}


# --------------------------------------------------------------------------- output


def render(doc: dict[str, Any]) -> str:
    out = []
    inputs = doc["inputs"]
    srcs = ", ".join(f"{k} {len(v)} file(s)" for k, v in inputs.items() if v)
    observed = doc["observed_s"]
    out.append(f"Observed {cd.format_duration(observed or 0)} over {doc['runs']} run(s) ({srcs}); "
               f"{len(doc['bad_lines'])} bad line(s) skipped")
    for b in doc["bad_lines"][:20]:
        out.append(f"  {_bad_line(b)}")
    if len(doc["bad_lines"]) > 20:
        out.append(f"  ... and {len(doc['bad_lines']) - 20} more (all of them are in --json)")
    if doc["classes"]:
        conf = next(iter(doc["classes"].values()))["confidence"]
        rows = [(_LABELS[c], str(r["count"]), f"{r['per_day']:.3g}",
                 f"{r['per_day_low']:.3g} - {r['per_day_high']:.3g}", "yes" if r["restart"] else "no (announced)")
                for c, r in doc["classes"].items()]
        out.append("")
        out += _table(("interruption class", "count", "per day", f"{conf:.0%} interval", "forces restart"), rows)
    if doc["costs"]:
        out.append("")
        out.append("Costs:")
        for name, c in doc["costs"].items():
            v = "unknown" if c["value"] is None else f"{c['value']:.4g}"
            n = f", {c['samples']} samples" if c["samples"] else ""
            out.append(f"  {name:<18} {v:<10} ({c['source']}{n})")
    if doc["intervals"]:
        out.append("")
        rows = []
        for label, iv in doc["intervals"].items():
            rows.append((label.replace("_", " "), cd.format_duration(iv["mtbf_s"]), _interval(iv["young_s"], iv["young_steps"]),
                         _interval(iv["daly_s"], iv["daly_steps"]),
                         " - ".join(cd.format_duration(t) for t in iv["range_s"])))
        out += _table(("restarts", "MTBF", "Young", "Daly", "Daly over rate interval"), rows)
    dt = doc["delta_t"]
    if dt:
        out.append("")
        out.append(f"Net daily saving dT = N_eligible*S - N_other*C - h*T0 = {dt['n_eligible_per_day']:.3g}*"
                   f"{dt['saved_per_event_s']:.1f} - {dt['n_other_per_day']:.3g}*{dt['rejection_s']:.3g} - "
                   f"{dt['monitoring_cost_s']:.1f} = {dt['net_saving_s']:.1f} s/day")
        out.append(f"  S = A*t_update - T_repair = {dt['age_steps']:.3g}*{dt['step_time_s']:.3g} - "
                   f"{dt['repair_s']:.3g} = {dt['saved_per_event_s']:.1f} s per eligible fault")
        if dt["break_even_every_days"] is not None:
            every = cd.format_duration(dt["break_even_every_days"] * cd.DAY_S)
            out.append(f"  break-even: one eligible failure every {every} ({dt['break_even_per_day']:.3g}/day)")
    rec = doc["recommendation"]
    if rec["interval_s"] is None and (rec.get("evidence") or {}).get("enough") is False:
        out.append("")
        out.append("Recommendation: none (see missing: observed time, below)")
    if rec["interval_s"] is not None:
        out.append("")
        l1 = {True: "L1 on", False: "L1 off", None: "L1 undecided"}[rec["use_l1"]]
        steps = f"checkpoint.every_steps = {rec['every_steps']}" if rec["every_steps"] else "interval"
        out.append(f"Recommendation: {steps} (about {cd.format_duration(rec['interval_s'])}), {l1}")
        out += [f"  - {r}" for r in rec["reasons"]]
    curve = doc["goodput"]["curve"]
    if curve:
        out.append("")
        xs = [p["interval_s"] for p in curve]
        chart = line_chart(xs, {"without L1": [p["without_l1"] for p in curve],
                                "with L1": [p["with_l1"] for p in curve]},
                           log_x=True, x_label="checkpoint interval (compute between snapshots)",
                           y_label="goodput", x_format=cd.format_duration, y_format=lambda v: f"{v:.1%}",
                           vline=rec["interval_s"] if rec["interval_s"] and math.isfinite(rec["interval_s"]) else None)
        out.append(chart)
    for n in doc["notes"]:
        out.append(f"note: {n}")
    for m in doc["missing"]:
        out.append(f"missing: {m}")
    w = doc.get("write")
    if w:
        if w.get("error"):
            out.append(f"--write {w['path']}: {w['error']}")
        else:
            what = "changed" if w["changed"] else "unchanged"
            out.append(f"{w['path']}: checkpoint.every_steps {w['old']} -> {w['new']} ({what})")
            if w["warning"]:
                out.append(f"warning: {w['warning']}")
    return "\n".join(out)


def plot_png(path: str, doc: dict[str, Any]) -> str | None:
    """Draw the goodput curves with matplotlib; returns an error message instead of raising."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed: pip install matplotlib (the chart above has the same data)"
    curve = doc["goodput"]["curve"]
    xs = [p["interval_s"] / 60.0 for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [p["without_l1"] for p in curve], label="without L1")
    ax.plot(xs, [p["with_l1"] for p in curve], label="with L1")
    tau = doc["recommendation"]["interval_s"]
    if tau and math.isfinite(tau):
        ax.axvline(tau / 60.0, linestyle="--", color="grey", label="recommended")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (min of compute)")
    ax.set_ylabel("expected goodput")
    ax.legend()
    ax.grid(True, alpha=0.3)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as exc:
        return f"cannot write {path}: {exc}"
    finally:
        plt.close(fig)
    return None


def _interval(seconds: float, steps: int | None) -> str:
    return cd.format_duration(seconds) + (f" ({steps} steps)" if steps is not None else "")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*r).rstrip() for r in (head, *rows)]


def _finite(obj: Any) -> Any:
    """JSON has no infinity: ``inf`` (nothing fails) becomes ``null``."""
    return finite(obj)


if __name__ == "__main__":
    sys.exit(main())
