"""Pure cadence math: Young, Daly's published cases, the goodput model, Garwood intervals, the paper's Delta T."""

from __future__ import annotations

import math

import pytest

from accelpact_slurm.ops import cadence as cd

MIN = 60.0
HOUR = 3600.0


def optimal_interval_numeric(checkpoint_cost_s: float, restart_cost_s: float, mtbf_s: float) -> float:
    """The interval that maximises :func:`expected_goodput`, by golden-section search on log tau.

    The oracle of Daly's closed form (the product uses the closed form); ``inf`` when nothing fails.
    """
    if math.isinf(mtbf_s):
        return math.inf
    lo, hi = math.log(max(checkpoint_cost_s, 1e-6) * 1e-3), math.log(mtbf_s * 50.0)
    phi = (math.sqrt(5.0) - 1.0) / 2.0

    def f(x: float) -> float:
        return -cd.expected_goodput(math.exp(x), checkpoint_cost_s, restart_cost_s, mtbf_s)

    a, b = lo, hi
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(200):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = f(d)
    return math.exp((a + b) / 2.0)


# --------------------------------------------------------------------------- Daly's published cases


@pytest.mark.parametrize("mtbf_s, expected_min, tol_min", [
    (24 * HOUR, 117.0, 0.5),
    (6 * HOUR, 57.0, 0.5),
    (15 * MIN, 9.1, 0.05),
])
def test_daly_published_cases(mtbf_s, expected_min, tol_min):
    # Daly (FGCS 2006): restart 10 min, checkpoint cost 5 min.
    tau = cd.daly_interval(5 * MIN, mtbf_s)
    assert tau / MIN == pytest.approx(expected_min, abs=tol_min)


@pytest.mark.parametrize("mtbf_s", [24 * HOUR, 6 * HOUR, 15 * MIN])
def test_daly_formula_is_near_the_numerical_optimum_of_the_goodput_model(mtbf_s):
    numeric = optimal_interval_numeric(5 * MIN, 10 * MIN, mtbf_s)
    assert cd.daly_interval(5 * MIN, mtbf_s) == pytest.approx(numeric, rel=0.01)


def test_restart_cost_does_not_move_the_optimum():
    a = optimal_interval_numeric(5 * MIN, 0.0, 6 * HOUR)
    b = optimal_interval_numeric(5 * MIN, 30 * MIN, 6 * HOUR)
    assert a == pytest.approx(b, rel=1e-4)


def test_young_is_sqrt_two_delta_m():
    assert cd.young_interval(5 * MIN, 24 * HOUR) == pytest.approx(120 * MIN)
    assert cd.young_interval(2.0, 50.0) == pytest.approx(math.sqrt(200.0))


def test_daly_exceeds_young_minus_delta_and_stays_below_young_for_small_costs():
    tau_y = cd.young_interval(10.0, 1e5)
    tau_d = cd.daly_interval(10.0, 1e5)
    assert tau_y - 10.0 < tau_d < tau_y


def test_daly_when_cost_exceeds_twice_the_mtbf_is_the_mtbf():
    assert cd.daly_interval(100.0, 40.0) == 40.0


def test_nothing_fails_means_no_finite_interval():
    assert math.isinf(cd.young_interval(5.0, math.inf))
    assert math.isinf(cd.daly_interval(5.0, math.inf))
    assert math.isinf(optimal_interval_numeric(5.0, 1.0, math.inf))


@pytest.mark.parametrize("cost, mtbf", [(-1.0, 10.0), (1.0, 0.0), (1.0, -5.0), (math.nan, 10.0)])
def test_bad_inputs_are_refused(cost, mtbf):
    with pytest.raises(ValueError):
        cd.daly_interval(cost, mtbf)


# --------------------------------------------------------------------------- goodput


def test_goodput_without_failures_is_compute_over_segment():
    assert cd.expected_goodput(90.0, 10.0, 60.0, math.inf) == pytest.approx(0.9)


def test_goodput_is_a_fraction_and_peaks_at_daly():
    m, d, r = 6 * HOUR, 5 * MIN, 10 * MIN
    tau = cd.daly_interval(d, m)
    peak = cd.expected_goodput(tau, d, r, m)
    assert 0 < peak < 1
    for factor in (0.3, 0.6, 1.7, 3.0):
        assert cd.expected_goodput(tau * factor, d, r, m) < peak


def test_goodput_is_zero_for_absurd_intervals_not_an_overflow():
    assert cd.expected_goodput(1e9, 1.0, 1.0, 10.0) == 0.0
    assert cd.expected_goodput(0.0, 1.0, 1.0, 10.0) == 0.0


def test_goodput_with_l1_reduces_to_daly_without_eligible_faults_or_guard():
    rate = 1 / (6 * HOUR)
    plain = cd.expected_goodput(600.0, 30.0, 300.0, 1 / rate)
    assert cd.goodput_with_l1(600.0, 30.0, 300.0, rate, 0.0, 0.77, 0.0) == pytest.approx(plain)


def test_goodput_with_l1_wins_when_eligible_faults_dominate():
    total, eligible = 1 / HOUR, 0.8 / HOUR
    without = cd.expected_goodput(600.0, 30.0, 300.0, 1 / total)
    with_l1 = cd.goodput_with_l1(600.0, 30.0, 300.0, total - eligible, eligible, 0.77, 0.002)
    assert with_l1 > without


def test_goodput_with_l1_loses_by_the_guard_overhead_when_nothing_is_eligible():
    rate = 1 / (6 * HOUR)
    without = cd.expected_goodput(600.0, 30.0, 300.0, 1 / rate)
    with_l1 = cd.goodput_with_l1(600.0, 30.0, 300.0, rate, 0.0, 0.77, 0.002)
    assert with_l1 == pytest.approx(without / 1.002)


@pytest.mark.parametrize("interval, step, expected", [(600.0, 2.0, 300), (1.0, 2.0, 1), (601.0, 2.0, 300),
                                                       (600.0, None, None), (math.inf, 2.0, None)])
def test_interval_steps(interval, step, expected):
    assert cd.interval_steps(interval, step) == expected


# --------------------------------------------------------------------------- rates


@pytest.mark.parametrize("count, lo, hi", [
    (0, 0.0, 3.6889),  # -ln(0.025)
    (1, 0.0253, 5.5716),
    (2, 0.2422, 7.2247),
    (10, 4.7954, 18.3904),
])
def test_garwood_interval_matches_tables(count, lo, hi):
    got_lo, got_hi = cd.poisson_count_interval(count, 0.95)
    assert got_lo == pytest.approx(lo, abs=1e-3)
    assert got_hi == pytest.approx(hi, abs=1e-3)


def test_garwood_interval_narrows_with_lower_confidence_and_contains_the_count():
    for n in (0, 3, 50, 400):
        lo95, hi95 = cd.poisson_count_interval(n, 0.95)
        lo80, hi80 = cd.poisson_count_interval(n, 0.80)
        assert lo95 <= lo80 <= n <= hi80 <= hi95


def test_garwood_rejects_bad_arguments():
    with pytest.raises(ValueError):
        cd.poisson_count_interval(-1)
    with pytest.raises(ValueError):
        cd.poisson_count_interval(1, 1.0)


def test_estimate_rate_scales_counts_by_exposure():
    r = cd.estimate_rate(3, 2 * cd.DAY_S)
    assert r.per_day == pytest.approx(1.5)
    assert r.low < r.rate < r.high
    d = r.to_dict()
    assert d["count"] == 3 and d["mtbf_s"] == pytest.approx(2 * cd.DAY_S / 3)
    with pytest.raises(ValueError):
        cd.estimate_rate(1, 0.0)


# --------------------------------------------------------------------------- the paper's Delta T


def test_paper_worked_example():
    # A = 5, 220 s updates, 0.77 s repair, h = 0.002 over 86,400 s.
    dt = cd.delta_t(n_eligible=0, n_other=0, age_steps=5, step_time_s=220, repair_s=0.77,
                    rejection_s=0.1, guard_overhead=0.002, baseline_s=86_400)
    assert dt.saved_per_event_s == pytest.approx(1099.2, abs=0.05)
    assert dt.monitoring_cost_s == pytest.approx(172.8)
    # "just one eligible failure every 6.3 days (1,099.2/172.8) offsets continuous guard monitoring"
    assert 6.3 <= dt.break_even_every_days < 6.4
    assert dt.break_even_every_days == pytest.approx(1099.23 / 172.8)


def test_paper_llama_examples():
    low = cd.delta_t(0.155, 0, 5, 220, 0.77, 0.1, 0.002)
    assert low.gross_saving_s == pytest.approx(170.4, abs=0.1)
    assert low.gross_saving_s / low.monitoring_cost_s == pytest.approx(0.986, abs=0.001)
    high = cd.delta_t(0.776, 0, 5, 220, 0.77, 0.1, 0.002)
    assert high.gross_saving_s == pytest.approx(852.9, abs=0.2)
    assert high.net_saving_s == pytest.approx(680.2, abs=0.2)


def test_rejections_raise_the_break_even_point():
    no_other = cd.delta_t(1, 0, 5, 220, 0.77, 0.1, 0.002)
    some = cd.delta_t(1, 100, 5, 220, 0.77, 0.1, 0.002)
    assert some.rejection_cost_s == pytest.approx(10.0)
    assert some.net_saving_s == pytest.approx(no_other.net_saving_s - 10.0)
    assert some.break_even_per_day > no_other.break_even_per_day


def test_longer_campaign_scales_the_break_even_to_per_day():
    week = cd.delta_t(0, 0, 5, 220, 0.77, 0.1, 0.002, baseline_s=7 * cd.DAY_S)
    day = cd.delta_t(0, 0, 5, 220, 0.77, 0.1, 0.002)
    assert week.break_even_per_day == pytest.approx(day.break_even_per_day)


def test_no_saving_per_event_has_no_break_even():
    dt = cd.delta_t(1, 0, 0, 220, 0.77, 0.1, 0.002)
    assert dt.break_even_per_day is None and dt.break_even_every_days is None


# --------------------------------------------------------------------------- decisions


def test_decide_l1_on_when_savings_beat_the_guard():
    eligible = cd.estimate_rate(10, 10 * cd.DAY_S)
    on, reason = cd.decide_l1(cd.delta_t(eligible.per_day, 0, 5, 220, 0.77, 0.1, 0.002), eligible)
    assert on and "net per day" in reason


def test_decide_l1_off_names_the_break_even():
    eligible = cd.estimate_rate(1, 100 * cd.DAY_S)
    on, reason = cd.decide_l1(cd.delta_t(eligible.per_day, 0, 5, 220, 0.77, 0.1, 0.002), eligible)
    assert not on and "pays off from one eligible fault every 6.36 d" in reason


def test_decide_l1_off_when_a_repair_saves_nothing():
    eligible = cd.estimate_rate(100, cd.DAY_S)
    on, reason = cd.decide_l1(cd.delta_t(100, 0, 0, 1.0, 0.77, 0.1, 0.002), eligible)
    assert not on and "saves nothing" in reason


def test_decide_interval_uses_the_point_estimate():
    restart = cd.estimate_rate(4, cd.DAY_S)
    tau, reason = cd.decide_interval(30.0, restart, 2.0)
    assert tau == pytest.approx(cd.daly_interval(30.0, cd.DAY_S / 4))
    assert "4 restart-causing" in reason and "steps" in reason


def test_decide_interval_without_failures_uses_the_upper_bound():
    restart = cd.estimate_rate(0, cd.DAY_S)
    tau, reason = cd.decide_interval(30.0, restart, None)
    assert tau == pytest.approx(cd.daly_interval(30.0, 1 / restart.high))
    assert "upper rate bound" in reason


def test_interval_range_brackets_the_point_estimate():
    restart = cd.estimate_rate(5, cd.DAY_S)
    short, long_ = cd.interval_range(30.0, restart)
    tau, _ = cd.decide_interval(30.0, restart, None)
    assert short < tau < long_
    short0, long0 = cd.interval_range(30.0, cd.estimate_rate(0, cd.DAY_S))
    assert math.isfinite(short0) and math.isinf(long0)


@pytest.mark.parametrize("seconds, text", [(45, "45 s"), (600, "10 min"), (3 * HOUR, "3 h"),
                                           (6.3 * cd.DAY_S, "6.3 d"), (1111 * cd.DAY_S, "1111 d"),
                                           (math.inf, "never")])
def test_format_duration(seconds, text):
    assert cd.format_duration(seconds) == text


# --------------------------------------------------------------------------- the terminal chart


def test_terminal_chart_draws_series_axes_and_legend():
    from accelpact_slurm.ops.termchart import line_chart

    xs = [10.0 ** (1 + i / 10) for i in range(21)]  # log-spaced, 10 to 1000
    peak = [cd.expected_goodput(x, 5.0, 10.0, 2000.0) for x in xs]
    flat = [0.5 for _ in xs]
    text = line_chart(xs, {"a": peak, "b": flat}, width=40, height=10, log_x=True, vline=100.0,
                      x_label="interval", y_label="goodput")
    lines = text.splitlines()
    assert lines[0].strip() == "goodput" and "interval" in lines[-2]
    assert "* a   o b   # both   | recommended" in lines[-1]
    body = "\n".join(lines[1:11])
    assert "*" in body and "o" in body and "|" in body
    assert all(len(line) <= 60 for line in lines)


def test_terminal_chart_marks_shared_cells_and_skips_nan():
    from accelpact_slurm.ops.termchart import OVERLAP, line_chart

    text = line_chart([1.0, 2.0, 3.0], {"a": [1.0, 2.0, math.nan], "b": [1.0, 2.0, 3.0]}, width=10, height=4)
    assert OVERLAP in text
    with pytest.raises(ValueError):
        line_chart([1.0], {"a": [1.0]})


# --------------------------------------------------------------------------- how much observed time is enough


def test_a_short_run_without_an_interruption_is_not_enough_and_says_how_much_is():
    """13 s without an interruption: the Garwood upper bound (3.69 / 13 s at 95 %) alone would set the interval.

    Negative control: without the evidence gate the analysis recommended a snapshot every 2 steps from it.
    """
    rate = cd.estimate_rate(0, 13.0)
    assert rate.high == pytest.approx(-math.log(0.025) / 13.0, rel=1e-6)
    proof = cd.evidence(0.07, 5.0, rate)
    assert not proof.enough and proof.max_regret > cd.MAX_REGRET and proof.needed_count == 0
    assert "not enough observed time" in proof.reason and "without one" in proof.reason
    # What it names is what the bound needs: enough at that time, not at 90 % of it.
    assert cd.evidence(0.07, 5.0, cd.estimate_rate(0, proof.needed_s)).enough
    assert not cd.evidence(0.07, 5.0, cd.estimate_rate(0, 0.9 * proof.needed_s)).enough
    # At rate 0 a snapshot every tau costs d / (tau + d): about sqrt(q d / 2T) at Daly's interval for T / q.
    q = -math.log(0.025)
    assert proof.needed_s == pytest.approx(q * 0.07 / (2 * cd.MAX_REGRET ** 2), rel=0.1)


def test_a_week_without_an_interruption_is_enough():
    proof = cd.evidence(2.0, 0.0, cd.estimate_rate(0, 7 * 86400.0))
    assert proof.enough and proof.needed_s is None and proof.max_regret < cd.MAX_REGRET


def test_with_interruptions_what_is_needed_is_counted_at_the_observed_rate():
    proof = cd.evidence(0.07, 5.0, cd.estimate_rate(1, 17.3))
    assert not proof.enough and proof.needed_count > 1
    assert proof.needed_s == pytest.approx(proof.needed_count * 17.3)
    assert f"about {proof.needed_count} restart-causing interruptions" in proof.reason
    n = proof.needed_count
    assert cd.evidence(0.07, 5.0, cd.estimate_rate(n, n * 17.3)).enough
    assert not cd.evidence(0.07, 5.0, cd.estimate_rate(n - 1, (n - 1) * 17.3)).enough


def test_regret_is_zero_at_the_optimum_and_d_over_tau_plus_d_without_failures():
    assert cd.regret(cd.daly_interval(5.0, 3600.0), 5.0, 0.0, 1 / 3600.0) == pytest.approx(0.0, abs=1e-12)
    assert cd.regret(95.0, 5.0, 0.0, 0.0) == pytest.approx(0.05)
    assert cd.regret(10.0, 5.0, 0.0, 1 / 3600.0) > cd.regret(100.0, 5.0, 0.0, 1 / 3600.0)
