"""Checkpoint cadence: Young, Daly, a goodput model with and without L1, the paper's Delta T.

Pure math and pure decisions: every function takes numbers and returns numbers, or ``(value, reason)``.  Nothing here
reads a file, a clock or the environment; ``accelpact_slurm.ops.cadence_analysis`` gathers the inputs and
``accelpact_slurm.cli.cadence`` prints the answers.  No torch: login-node tools use it.

Units are seconds and events per second unless a name says otherwise.  An interval ``tau`` is *compute* time between
checkpoints (Daly's convention): the wall time of one segment is ``tau + checkpoint_cost``.

References:
    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974.
    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006.
    F. Garwood, "Fiducial limits for the Poisson distribution", Biometrika 28, 1936.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_S = 86_400.0
#: Beyond this exponent ``exp`` overflows; goodput is then 0 for practical purposes.
_MAX_EXP = 700.0


# --------------------------------------------------------------------------- intervals


def young_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 * delta * M)``; ``inf`` when nothing fails."""
    _check_cost(checkpoint_cost_s)
    if math.isinf(mtbf_s):
        return math.inf
    _check_mtbf(mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (FGCS 2006, eq. 37).

    ``sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d`` for ``d < 2M``, else ``M``.  With restart 10 min and
    checkpoint cost 5 min this gives about 117 min at M = 24 h, 57 min at 6 h and 9.1 min at 15 min (Daly's cases).
    """
    _check_cost(checkpoint_cost_s)
    if math.isinf(mtbf_s):
        return math.inf
    _check_mtbf(mtbf_s)
    d, m = checkpoint_cost_s, mtbf_s
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def interval_steps(interval_s: float, step_time_s: float | None) -> int | None:
    """An interval in whole optimizer steps (at least 1); ``None`` without a step time."""
    if step_time_s is None or step_time_s <= 0 or math.isnan(interval_s):
        return None
    if math.isinf(interval_s):
        return None
    return max(1, int(round(interval_s / step_time_s)))


# --------------------------------------------------------------------------- goodput


def expected_goodput(interval_s: float, checkpoint_cost_s: float, restart_cost_s: float, mtbf_s: float) -> float:
    """Useful fraction of wall time under Daly's exponential model.

    Daly's expected wall time for ``Ts`` of work is ``M e^(R/M) (e^((tau + d)/M) - 1) Ts / tau``; goodput is ``Ts``
    over that.  Failures during checkpoints and restarts are counted (the model is exact for Poisson failures).
    Without failures it is ``tau / (tau + d)``.
    """
    if interval_s <= 0:
        return 0.0
    if math.isinf(mtbf_s):
        return interval_s / (interval_s + checkpoint_cost_s)
    _check_mtbf(mtbf_s)
    m = mtbf_s
    exponent = (interval_s + checkpoint_cost_s) / m
    if exponent + restart_cost_s / m > _MAX_EXP:
        return 0.0
    wall_per_work = m * math.exp(restart_cost_s / m) * math.expm1(exponent) / interval_s
    return 1.0 / wall_per_work


def goodput_with_l1(
    interval_s: float,
    checkpoint_cost_s: float,
    restart_cost_s: float,
    restart_rate: float,
    eligible_rate: float,
    repair_s: float,
    guard_overhead: float,
) -> float:
    """Goodput when L1 repairs its eligible faults in place.

    Eligible faults leave the restart rate (``restart_rate`` must already exclude them); each costs ``repair_s`` of
    wall time instead, with zero replay.  The boundary guard slows compute by ``1 + guard_overhead``.  So
    ``g = g_daly(M = 1/restart_rate) * (1 - eligible_rate * repair_s) / (1 + h)``.
    """
    base = expected_goodput(interval_s, checkpoint_cost_s, restart_cost_s, _mtbf(restart_rate))
    repair_loss = min(1.0, max(0.0, eligible_rate * repair_s))
    return base * (1.0 - repair_loss) / (1.0 + max(0.0, guard_overhead))


# --------------------------------------------------------------------------- rates


def poisson_count_interval(count: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Garwood) two-sided interval on the mean of a Poisson count.

    The lower limit solves ``P(X >= n | mu) = alpha/2`` (0 when n = 0); the upper solves ``P(X <= n | mu) = alpha/2``.
    Equivalent to the chi-square form ``chi2(alpha/2, 2n)/2 .. chi2(1 - alpha/2, 2n + 2)/2`` without needing scipy.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0
    hi_bracket = count + 20.0 * math.sqrt(count + 1.0) + 50.0
    upper = _bisect(lambda mu: _poisson_cdf(count, mu) - tail, 0.0, hi_bracket, decreasing=True)
    if count == 0:
        return 0.0, upper
    lower = _bisect(lambda mu: (1.0 - _poisson_cdf(count - 1, mu)) - tail, 0.0, hi_bracket, decreasing=False)
    return lower, upper


@dataclass(frozen=True)
class Rate:
    """A count over an exposure, with its point estimate and exact interval (events/s)."""

    count: int
    exposure_s: float
    rate: float
    low: float
    high: float
    confidence: float

    @property
    def per_day(self) -> float:
        return self.rate * DAY_S

    def to_dict(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "per_day": self.rate * DAY_S,
            "per_day_low": self.low * DAY_S,
            "per_day_high": self.high * DAY_S,
            "mtbf_s": _mtbf(self.rate) if self.rate > 0 else None,
            "confidence": self.confidence,
        }


def estimate_rate(count: int, exposure_s: float, confidence: float = 0.95) -> Rate:
    """Rate of ``count`` events over ``exposure_s`` seconds with a Garwood interval."""
    if exposure_s <= 0:
        raise ValueError(f"exposure must be positive, got {exposure_s!r} s")
    lo, hi = poisson_count_interval(count, confidence)
    return Rate(count, exposure_s, count / exposure_s, lo / exposure_s, hi / exposure_s, confidence)


# --------------------------------------------------------------------------- the paper's Delta T


@dataclass(frozen=True)
class DeltaT:
    """``dT = N_eligible * S - N_other * C - h * T0`` and its break-even point (paper, eq. for Delta T)."""

    saved_per_event_s: float  # S = A * t_update - T_repair
    monitoring_cost_s: float  # h * T0
    rejection_cost_s: float  # N_other * C
    gross_saving_s: float  # N_eligible * S
    net_saving_s: float
    baseline_s: float
    break_even_per_day: float | None  # eligible failures per day at which dT = 0
    break_even_every_days: float | None  # one eligible failure every ... days

    def to_dict(self) -> dict[str, float | None]:
        return dict(self.__dict__)


def delta_t(
    n_eligible: float,
    n_other: float,
    age_steps: float,
    step_time_s: float,
    repair_s: float,
    rejection_s: float,
    guard_overhead: float,
    baseline_s: float = DAY_S,
) -> DeltaT:
    """Net cluster time saved by L1 over a campaign of ``baseline_s`` (counts are for that campaign).

    The paper's example: A = 5, t_update = 220 s, T_repair = 0.77 s, h = 0.002, T0 = 86,400 s gives S = 1,099.2 s, h
    T0 = 172.8 s and break-even at one eligible failure every 6.3 days.
    """
    saved = age_steps * step_time_s - repair_s
    monitoring = guard_overhead * baseline_s
    rejection = n_other * rejection_s
    gross = n_eligible * saved
    days = baseline_s / DAY_S
    if saved > 0:
        per_campaign = (monitoring + rejection) / saved
        per_day = per_campaign / days
        every = (1.0 / per_day) if per_day > 0 else math.inf
    else:
        per_day, every = None, None
    return DeltaT(saved, monitoring, rejection, gross, gross - rejection - monitoring, baseline_s, per_day, every)


# --------------------------------------------------------------------------- decisions


def decide_l1(dt: DeltaT, eligible: Rate) -> tuple[bool, str]:
    """Whether to run with the boundary guard and L1, and why (pure)."""
    if dt.saved_per_event_s <= 0:
        return False, (
            f"an L1 repair saves nothing: replaying the checkpoint age costs no more than the repair "
            f"(S = {dt.saved_per_event_s:.1f} s)"
        )
    if dt.net_saving_s > 0:
        return True, (
            f"L1 saves {dt.net_saving_s:.1f} s net per day: {eligible.per_day:.3g} eligible faults/day "
            f"x {dt.saved_per_event_s:.1f} s exceed the guard's {dt.monitoring_cost_s:.1f} s/day"
        )
    every = dt.break_even_every_days
    return False, (
        f"L1 costs {-dt.net_saving_s:.1f} s per day at the observed {eligible.per_day:.3g} eligible faults/day; "
        f"it pays off from one eligible fault every {_fmt_s(every * DAY_S)}"
    )


def decide_interval(
    checkpoint_cost_s: float,
    restart: Rate,
    step_time_s: float | None,
) -> tuple[float, str]:
    """Daly's interval for the restart rate, and why; with no failure seen, the rate's upper bound.

    Choosing the upper bound when nothing failed is deliberate: zero failures over a short history is weak evidence,
    and a too-long interval costs more than a too-short one near the optimum (the goodput curve is flat to the left).
    """
    if restart.count > 0:
        mtbf, basis = 1.0 / restart.rate, f"{restart.count} restart-causing interruptions"
    elif restart.high > 0:
        mtbf = 1.0 / restart.high
        basis = f"no restart-causing interruption seen; using the {restart.confidence:.0%} upper rate bound"
    else:
        return math.inf, "no exposure: cannot estimate a failure rate"
    tau = daly_interval(checkpoint_cost_s, mtbf)
    steps = interval_steps(tau, step_time_s)
    in_steps = f" = {steps} steps of {step_time_s:.3g} s" if steps is not None else ""
    return tau, (
        f"Daly's optimum for MTBF {_fmt_s(mtbf)} ({basis}) and checkpoint cost {_fmt_s(checkpoint_cost_s)}: "
        f"{_fmt_s(tau)}{in_steps}"
    )


def interval_range(checkpoint_cost_s: float, restart: Rate) -> tuple[float, float]:
    """Daly's interval at the high and the low end of the rate interval (short, long)."""
    short = daly_interval(checkpoint_cost_s, _mtbf(restart.high)) if restart.high > 0 else math.inf
    long_ = daly_interval(checkpoint_cost_s, _mtbf(restart.low)) if restart.low > 0 else math.inf
    return short, long_


# --------------------------------------------------------------------------- evidence

#: The most goodput a recommendation may cost, against the best interval for the true restart rate, anywhere in
#: the rate's confidence interval: with less evidence it is the observation window that picks the interval.
MAX_REGRET = 0.01


def regret(interval_s: float, checkpoint_cost_s: float, restart_cost_s: float, rate: float) -> float:
    """Goodput lost by checkpointing every ``interval_s`` when the restart rate is ``rate``, against Daly's interval
    for that rate (never checkpointing when nothing fails: ``d / (tau + d)`` then)."""
    if not math.isfinite(interval_s):
        return 0.0 if rate <= 0 else 1.0
    if rate <= 0:
        return checkpoint_cost_s / (interval_s + checkpoint_cost_s)
    mtbf = 1.0 / rate
    best = expected_goodput(daly_interval(checkpoint_cost_s, mtbf), checkpoint_cost_s, restart_cost_s, mtbf)
    return max(0.0, best - expected_goodput(interval_s, checkpoint_cost_s, restart_cost_s, mtbf))


@dataclass(frozen=True)
class Evidence:
    """Whether the observed time supports a cadence: the worst :func:`regret` of the recommended interval over
    the rate's confidence interval, and what would be enough (``needed_s``: observed time; ``needed_count``:
    restart-causing interruptions, at the observed rate when some were seen)."""

    enough: bool
    max_regret: float
    allowed: float
    needed_s: float | None
    needed_count: int | None
    reason: str

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def worst_regret(checkpoint_cost_s: float, restart_cost_s: float, restart: Rate) -> float:
    """The recommended interval's (:func:`decide_interval`) worst regret at either end of the rate interval."""
    tau, _ = decide_interval(checkpoint_cost_s, restart, None)
    return max(regret(tau, checkpoint_cost_s, restart_cost_s, r) for r in (restart.low, restart.high))


def evidence(checkpoint_cost_s: float, restart_cost_s: float, restart: Rate,
             allowed: float = MAX_REGRET) -> Evidence:
    """Is the observed time enough for a recommendation, and if not, how much would be (pure).

    The rate is known only within its Garwood interval (``restart.low .. restart.high``, at ``confidence``).  The
    recommendation may cost at most ``allowed`` goodput wherever in that interval the true rate is.  With no
    interruption seen the interval is ``0 .. -ln((1 - c) / 2) / T``: the upper bound, and with it the interval
    recommended, is set by the observed time ``T`` alone, and at rate 0 checkpointing every ``tau`` costs
    ``d / (tau + d)``; that is below ``allowed`` only once ``T`` is long enough.  With interruptions seen the
    interval narrows as their count grows; what is needed is counted at the observed rate.
    """
    conf = restart.confidence
    worst = worst_regret(checkpoint_cost_s, restart_cost_s, restart)
    span = (f"the {conf:.0%} rate interval {restart.low * DAY_S:.3g} - {restart.high * DAY_S:.3g} per day "
            f"({restart.count} restart-causing interruption(s) in {_fmt_s(restart.exposure_s)})")
    if worst <= allowed:
        return Evidence(True, worst, allowed, None, None,
                        f"enough observed time: over {span} the recommended interval costs at most {worst:.2%} "
                        f"goodput against the best one for the true rate (allowed {allowed:.0%})")
    head = (f"not enough observed time for a recommendation: over {span} the interval it would recommend could "
            f"cost up to {worst:.1%} goodput against the best one for the true rate (allowed {allowed:.0%})")
    if restart.count == 0:
        lo, hi = restart.exposure_s, restart.exposure_s
        while worst_regret(checkpoint_cost_s, restart_cost_s, estimate_rate(0, hi, conf)) > allowed:
            lo, hi = hi, hi * 2.0
            if hi > 1e6 * DAY_S:
                return Evidence(False, worst, allowed, None, None, head)
        for _ in range(60):  # the regret at rate 0 falls as T grows: bisect to 1 %
            mid = (lo + hi) / 2.0
            if worst_regret(checkpoint_cost_s, restart_cost_s, estimate_rate(0, mid, conf)) > allowed:
                lo = mid
            else:
                hi = mid
            if hi - lo < 0.01 * hi:
                break
        return Evidence(False, worst, allowed, hi, 0,
                        f"{head}; with no interruption seen that needs about {_fmt_s(hi)} observed "
                        f"without one (the upper rate bound {-math.log((1.0 - conf) / 2.0):.3g} / T sets the "
                        f"interval, and at rate 0 checkpointing every tau costs d / (tau + d))")
    rate = restart.rate

    def ok(n: int) -> bool:
        return worst_regret(checkpoint_cost_s, restart_cost_s, estimate_rate(n, n / rate, conf)) <= allowed

    low, high = restart.count, restart.count * 2
    while not ok(high):  # doubling, then bisection: each look sums a Poisson tail of n terms
        low, high = high, high * 2
        if high > 1_000_000:
            return Evidence(False, worst, allowed, None, None, head)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid, high)
    return Evidence(False, worst, allowed, high / rate, high,
                    f"{head}; at the observed rate that needs about {high} restart-causing interruptions, "
                    f"about {_fmt_s(high / rate)} observed")


# --------------------------------------------------------------------------- helpers


def _mtbf(rate: float) -> float:
    return math.inf if rate <= 0 else 1.0 / rate


def _check_cost(cost: float) -> None:
    if not cost >= 0 or math.isinf(cost):
        raise ValueError(f"checkpoint cost must be a finite number >= 0 s, got {cost!r}")


def _check_mtbf(mtbf: float) -> None:
    if not mtbf > 0:
        raise ValueError(f"MTBF must be positive, got {mtbf!r} s")


def _poisson_cdf(n: int, mu: float) -> float:
    """P(X <= n) for X ~ Poisson(mu), summed in log space (stable for large mu)."""
    if n < 0:
        return 0.0
    if mu <= 0:
        return 1.0
    log_mu = math.log(mu)
    total = 0.0
    for k in range(n + 1):
        total += math.exp(-mu + k * log_mu - math.lgamma(k + 1.0))
    return min(1.0, total)


def _bisect(f, lo: float, hi: float, decreasing: bool) -> float:
    for _ in range(200):
        mid = (lo + hi) / 2.0
        value = f(mid)
        if (value > 0) == decreasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def _fmt_s(seconds: float) -> str:
    """A duration for people: 45 s, 12.5 min, 3.2 h, 6.3 d."""
    if math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 2 * DAY_S:
        return f"{seconds / 3600:.3g} h"
    days = seconds / DAY_S
    return f"{days:.3g} d" if days < 100 else f"{days:.0f} d"


format_duration = _fmt_s
