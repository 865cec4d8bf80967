"""The analysis behind ``accelpact-cadence``: failure logs and event logs in, the cadence document out.

:func:`analyse` reads the Slurm failure logs (sacct, jobcomp) and the runs' event logs
(:mod:`accelpact_slurm.ops.failure_logs`), then computes the interruption rates, the checkpoint intervals
with and without L1, the goodput curves and the net daily saving Delta T (:mod:`accelpact_slurm.ops.cadence`,
pure math); it returns the ``accelpact-cadence/1`` JSON document.  ``accelpact_slurm.cli.cadence`` parses
the flags, calls it and prints the document.

This module must not import torch: login-node tools use it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from accelpact_slurm.ops import cadence as cd
from accelpact_slurm.ops import failure_logs as fl
from accelpact_slurm.core.events import BadLine

SCHEMA = "accelpact-cadence/1"
#: Used when neither a flag nor the event logs give them (the paper's measurements).
DEFAULT_GUARD_OVERHEAD = 0.002
DEFAULT_REPAIR_S = 0.77
DEFAULT_REJECTION_S = 0.1


# --------------------------------------------------------------------------- analysis


def analyse(args: argparse.Namespace) -> dict[str, Any]:
    """Read every log, then compute rates, intervals, goodput and Delta T; returns the JSON document."""
    bad: list[BadLine] = []
    runs = [r for f in args.sacct for r in fl.parse_sacct(f, bad)]
    runs += [r for f in args.jobcomp for r in fl.parse_jobcomp(f, bad)]
    hist = fl.build_history(runs, fl.scan_events(args.events, bad))
    exposure = args.observed_s if args.observed_s is not None else hist.exposure_s
    doc: dict[str, Any] = {
        "schema": SCHEMA, "inputs": {"sacct": args.sacct, "jobcomp": args.jobcomp, "events": args.events},
        "bad_lines": [{"path": b.path, "lineno": b.lineno, "reason": b.reason} for b in bad],
        "observed_s": exposure, "runs": hist.runs, "classes": {}, "restart_rate": {}, "costs": {},
        "intervals": {}, "goodput": {"curve": [], "at_recommended": {}}, "delta_t": None,
        "recommendation": {"use_l1": None, "every_steps": None, "interval_s": None, "reasons": []},
        "interruptions": [i.to_dict() for i in hist.interruptions], "notes": list(hist.notes), "missing": [],
        "write": None,
    }
    if not exposure or exposure <= 0:
        doc["missing"].append("observed time (no run with a start and end): pass --observed-s")
        return doc
    conf = args.confidence
    rates = {c: cd.estimate_rate(hist.count(c), exposure, conf) for c in fl.CLASSES}
    doc["classes"] = {c: dict(r.to_dict(), restart=c in fl.RESTART_CLASSES) for c, r in rates.items()}
    n_restart = sum(rates[c].count for c in fl.RESTART_CLASSES)
    without = cd.estimate_rate(n_restart, exposure, conf)
    with_l1 = cd.estimate_rate(n_restart - rates[fl.COMM_COMMITTED].count, exposure, conf)
    eligible, other = rates[fl.COMM_COMMITTED], rates[fl.UNCOMMITTED]
    doc["restart_rate"] = {"without_l1": without.to_dict(), "with_l1": with_l1.to_dict()}

    costs = doc["costs"]
    for name, flag, default in (
        ("step_time_s", args.step_time_s, None), ("checkpoint_cost_s", args.checkpoint_cost_s, None),
        ("restart_cost_s", args.restart_cost_s, None), ("repair_s", args.repair_s, DEFAULT_REPAIR_S),
        ("rejection_s", args.rejection_s, DEFAULT_REJECTION_S), ("guard_overhead", args.guard_overhead,
                                                                  DEFAULT_GUARD_OVERHEAD),
        ("age_steps", args.age_steps, None),
    ):
        costs[name] = _pick(flag, hist.costs.get(name), default)
    step, delta = costs["step_time_s"]["value"], costs["checkpoint_cost_s"]["value"]
    if delta is None:
        doc["missing"].append("checkpoint cost: pass --checkpoint-cost-s (no checkpoint event has blocking_s)")
        return doc
    if step is None:
        doc["missing"].append("step time: pass --step-time-s (no step events)")
    restart_cost = costs["restart_cost_s"]["value"]
    if restart_cost is None:
        restart_cost = 0.0
        doc["notes"].append("restart cost unknown: goodput assumes R = 0 (pass --restart-cost-s)")
    repair, h = costs["repair_s"]["value"], costs["guard_overhead"]["value"]

    reasons = doc["recommendation"]["reasons"]
    taus = {}
    for label, rate in (("without_l1", without), ("with_l1", with_l1)):
        tau, why = cd.decide_interval(delta, rate, step)
        short, long_ = cd.interval_range(delta, rate)
        mtbf = 1.0 / rate.rate if rate.count else (1.0 / rate.high if rate.high else math.inf)
        young = cd.young_interval(delta, mtbf)
        taus[label] = tau
        doc["intervals"][label] = {
            "mtbf_s": mtbf, "young_s": young, "young_steps": cd.interval_steps(young, step),
            "daly_s": tau, "daly_steps": cd.interval_steps(tau, step), "range_s": [short, long_],
            "range_steps": [cd.interval_steps(short, step), cd.interval_steps(long_, step)], "reason": why}

    age = costs["age_steps"]["value"]
    if age is None and step is not None and math.isfinite(taus["without_l1"]):
        age = taus["without_l1"] / step / 2.0
        costs["age_steps"] = {"value": age, "source": "half Daly's interval without L1 (uniform fault time)",
                              "samples": 0}
    use_l1 = None
    if step is not None and age is not None:
        dt = cd.delta_t(eligible.per_day, other.per_day, age, step, repair, costs["rejection_s"]["value"], h)
        doc["delta_t"] = dict(dt.to_dict(), n_eligible_per_day=eligible.per_day, n_other_per_day=other.per_day,
                              age_steps=age, step_time_s=step, repair_s=repair,
                              rejection_s=costs["rejection_s"]["value"], guard_overhead=h)
        use_l1, why_l1 = cd.decide_l1(dt, eligible)
        reasons.append(why_l1)
    chosen = "with_l1" if use_l1 else "without_l1"
    tau = taus[chosen]
    # Too little observed time: the window, not the job, would pick the interval (13 s without an interruption
    # recommended a snapshot every 2 steps and L1 off); nothing is recommended and --write writes nothing.
    proof = cd.evidence(delta, restart_cost, with_l1 if use_l1 else without,
                        getattr(args, "max_regret", cd.MAX_REGRET))
    doc["recommendation"]["evidence"] = proof.to_dict()
    if not proof.enough:
        reasons[:] = [proof.reason]
        doc["recommendation"]["use_l1"] = None
        doc["missing"].append(f"observed time: {proof.reason}")
        tau = math.inf
    else:
        reasons.append(doc["intervals"][chosen]["reason"])
        reasons.append(proof.reason)
        doc["recommendation"].update(use_l1=use_l1, interval_s=tau, every_steps=cd.interval_steps(tau, step))

    # Both curves use the MTBFs the intervals used (the upper rate bound when nothing failed).
    m_without, m_with = doc["intervals"]["without_l1"]["mtbf_s"], doc["intervals"]["with_l1"]["mtbf_s"]
    curves = {
        "without_l1": lambda t: cd.expected_goodput(t, delta, restart_cost, m_without),
        "with_l1": lambda t: cd.goodput_with_l1(t, delta, restart_cost, 1.0 / m_with, eligible.rate, repair, h),
    }
    finite = [t for t in taus.values() if math.isfinite(t)]
    if not finite:
        return doc
    grid = _grid(min(finite) / 10.0, max(finite) * 10.0)
    doc["goodput"]["curve"] = [{"interval_s": t, **{k: f(t) for k, f in curves.items()}} for t in grid]
    doc["goodput"]["at_recommended"] = {"interval_s": tau, **{k: f(tau) if math.isfinite(tau) else None
                                                              for k, f in curves.items()}}
    short, long_ = doc["intervals"][chosen]["range_s"]
    rng = doc["intervals"][chosen]["range_steps"]
    if proof.enough and math.isfinite(tau) and math.isfinite(short) and math.isfinite(long_):
        f = curves[chosen]
        loss = max(f(tau) - f(short), f(tau) - f(long_))
        span = f"{rng[0]}-{rng[1]} steps" if None not in rng else f"{cd.format_duration(short)}-{cd.format_duration(long_)}"
        reasons.append(f"over the {conf:.0%} rate interval the optimum spans {span}; at the point estimate "
                       f"either end costs {loss:.2%} goodput or less")
    return doc


def _pick(flag: float | None, measured: fl.Measured | None, default: float | None) -> dict[str, Any]:
    """Flag > measured from event logs > default, with where the value came from."""
    if flag is not None:
        return {"value": flag, "source": "flag", "samples": 0}
    if measured is not None and measured.value is not None:
        return {"value": measured.value, "source": measured.source, "samples": measured.samples}
    if default is not None:
        return {"value": default, "source": "default (paper's measurement)", "samples": 0}
    return {"value": None, "source": "unknown", "samples": 0}


def _grid(lo: float, hi: float, points: int = 61) -> list[float]:
    a, b = math.log(lo), math.log(hi)
    return [math.exp(a + (b - a) * i / (points - 1)) for i in range(points)]
