"""`echobench tune`'s loop: measure the picks of every scale and node count (and of a model card's
layouts, as card runs: echobench.tune.cards) as one sweep (the existing executors, preflight
included), hold the predictions (predict's; a card's predict_card's) against the measured records,
recalibrate the profile where the residuals share a bias, re-rank, and measure again until the
measured winner is the predicted one, nothing predicted above it is left unmeasured, the rounds or
the device-hour budget run out.

    TUNE/measure.yaml      the matrix of every candidate picked so far (an include per run)
    TUNE/sweep/            its sweep (echobench.sweep.loop): run directories, records, results.csv
    TUNE/profile-tuned.yaml  the profile recalibrated from the residuals (beside the shipped one)
    TUNE/tune.json         candidates, pruned and why, predictions, picks per round, measured, winners
    TUNE/report.md         the report (echobench.tune.output)
    TUNE/winners/          per scale and node count: the winner as a `run --config` file and a one-run matrix

An interrupted tune resumes: the same command re-derives the same candidates and picks, and the
sweep runs only what has no record yet (ok runs never run twice).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from echobench.records.config import RunConfig
from echobench.records.results import now_iso
from echobench.records.states import RunState
from echobench.hardware.profile import HardwareProfile, InStepFactor, save_profile
from echobench.sweep.matrix import expand, parse_matrix
from echobench.predict import predict
from echobench.predict.pricing import Rates, in_situ_factor
from echobench.sweep.loop import SweepOptions, run_sweep
from echobench.sweep.state import record_state, run_dir
from echobench.tune.space import Candidate, Problem, TuneError, TuneFile, cluster_sections, picks, tied

FIT_BOUNDS = (1 / 3, 3.0)  # InStepFactor's


@dataclass
class Measured:
    """A measured candidate: its record's status and figures."""

    run_id: str
    status: str
    samples_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    error: str = ""
    step_times_s: list[float] | None = None  # each measured step (the noise the winner is judged with)

    @property
    def ok(self) -> bool:
        return self.status == RunState.OK and bool(self.samples_per_s)


@dataclass
class Round:
    number: int
    profile: str
    run_ids: list[str]
    wall_s: float = 0.0
    device_hours: float = 0.0
    exit_code: int = 0


@dataclass
class TuneResult:
    problems: list[Problem]
    shipped: HardwareProfile
    profile: HardwareProfile  # the one the final ranking is on (the shipped one, or the recalibrated)
    measured: dict[str, Measured]
    rounds: list[Round] = field(default_factory=list)
    stops: dict[str, str] = field(default_factory=dict)  # problem key -> why its measuring stopped
    shipped_predictions: dict[str, float] = field(default_factory=dict)  # run id -> samples/s on the shipped profile
    fit_note: str | None = None
    interrupted: bool = False
    # run id -> the device-hours charged to it: its round's share, or what an earlier (interrupted)
    # tune in the same directory charged it, so that a resumed tune keeps counting its budget
    charges: dict[str, float] = field(default_factory=dict)

    @property
    def device_hours(self) -> float:
        return sum(self.charges.values())


MeasureFn = Callable[[Sequence[Candidate]], dict[str, Measured]]


# ---- measuring through a sweep ----

def measure_matrix_text(spec: TuneFile, candidates: Sequence[Candidate], folder: Path) -> str:
    """A matrix of the picked candidates (an include each) with the tune file's sections (its site
    named: space.cluster_sections), to be written into `folder`: what the sweep runs, and what a user
    can sweep again."""
    doc = {"name": f"{spec.name}-measure", **cluster_sections(spec, folder),
           "defaults": spec.defaults, "include": [dict(c.settings) for c in candidates]}
    return (f"# Written by `echobench tune` ({spec.name}): the candidates it measures, one include each.\n"
            + yaml.safe_dump(doc, sort_keys=False))


def sweep_measure(spec: TuneFile, tune_dir: Path, console, executor: str | None = None, preflight: bool = True,
                  poll_s: float | None = None) -> tuple[MeasureFn, dict]:
    """A measure function that runs the candidates picked so far as one sweep in TUNE/sweep (ok
    runs never again) and reads their records; `info` collects each call's wall time and exit code."""
    picked: dict[str, Candidate] = {}
    info: dict = {}

    def measure(candidates: Sequence[Candidate]) -> dict[str, Measured]:
        picked.update({c.run_id: c for c in candidates})
        path = tune_dir / "measure.yaml"
        text = measure_matrix_text(spec, list(picked.values()), tune_dir)
        path.write_text(text)
        matrix = parse_matrix(text, path)
        plan = expand(matrix, executor)
        ids = {r.id for r in plan.runs}
        if missing := [rid for rid in picked if rid not in ids]:  # the tune and the sweep disagree on a run
            raise TuneError(f"{path}: the sweep would not run {', '.join(missing)} "
                            f"({'; '.join(s.reason for s in plan.skipped) or 'a different run id'})")
        opts = SweepOptions(executor or spec.executor, tune_dir / "sweep", wait=True, preflight=preflight,
                            poll_s=poll_s)
        started = time.monotonic()
        info["exit_code"] = run_sweep(matrix, plan.runs, opts, console)
        info["wall_s"] = time.monotonic() - started
        return read_measured(tune_dir / "sweep", [c.run_id for c in candidates])

    return measure, info


def read_measured(sweep_dir: Path, run_ids: Sequence[str]) -> dict[str, Measured]:
    """The records of these runs in the sweep (those with none are left out)."""
    out = {}
    for rid in run_ids:
        state, record, error = record_state(run_dir(sweep_dir, rid))
        if record is None and state == RunState.NEW:
            continue
        out[rid] = Measured(rid, state, record.samples_per_s if record else None,
                            record.step_time_s if record else None, record.mfu if record else None,
                            record.peak_mem_gib if record else None, error, record.step_times_s if record else None)
    return out


# ---- holding predictions against measurements ----

def kendall_tau(predicted: Sequence[float], measured: Sequence[float]) -> float | None:
    """Kendall's tau-b between the predicted and measured samples/s of the measured candidates
    (None under two, or where either side is constant)."""
    if len(predicted) < 2:
        return None
    from scipy.stats import kendalltau  # lazy: scipy's import time, for this function alone

    tau = kendalltau(predicted, measured).statistic
    return None if tau is None or math.isnan(tau) else float(tau)


def residuals(problems: Sequence[Problem], measured: dict[str, Measured]) -> dict[str, float]:
    """Per measured candidate: measured / predicted samples/s - 1 on the current predictions."""
    out = {}
    for p in problems:
        for c in p.measurable:
            m = measured.get(c.run_id)
            if m is not None and m.ok:
                out[c.run_id] = m.samples_per_s / c.samples_per_s - 1
    return out


def consistent_bias(res: dict[str, float], threshold: float) -> bool:
    """Every residual beyond the threshold on the same side: the model is off by a common factor."""
    values = list(res.values())
    return len(values) >= 2 and (all(r > threshold for r in values) or all(r < -threshold for r in values))


def misranked(problems: Sequence[Problem], measured: dict[str, Measured]) -> bool:
    """Whether, among what was measured, some problem's measured winner is not its predicted best."""
    for p in problems:
        ok = [c for c in p.measurable if (m := measured.get(c.run_id)) is not None and m.ok]
        if len(ok) >= 2 and measured_winner(p, measured) is not ok[0]:
            return True
    return False


def _factor(profile: HardwareProfile) -> float:
    """The factor the profile now puts on a step's compute: the in_step a tune fitted (1 without)."""
    return in_situ_factor(Rates(profile))


def scaled(profile: HardwareProfile, compute: float, bandwidth: float, source: str = "trial") -> HardwareProfile:
    """The profile with its compute factor (in_step) x `compute` and every collective fit's bus
    bandwidth x `bandwidth`."""
    base = profile.in_step.factor if profile.in_step else 1.0
    factor = min(max(base * compute, FIT_BOUNDS[0]), FIT_BOUNDS[1])

    def fit(ab):
        return ab if bandwidth == 1 else ab.model_copy(update={
            "bus_gbps": ab.bus_gbps * bandwidth, "source": f"{ab.source}; bus bandwidth x {bandwidth:.3g} {source}"})

    return profile.model_copy(update={
        "in_step": InStepFactor(factor=factor, fitted_on=[], source=source) if compute != 1 or profile.in_step else None,
        "links": {link: {op: fit(ab) for op, ab in ops.items()} for link, ops in profile.links.items()},
        "link_kinds": {link: {op: [fit(ab) for ab in fits] for op, fits in ops.items()}
                       for link, ops in profile.link_kinds.items()}})


def _rate(run, profile: HardwareProfile) -> float:
    """Predicted samples/s of a measured run on `profile`: a RunConfig by predict, a tune candidate
    by its own pricing (Echo's predict, a model card's predict_card)."""
    return predict(run, profile).samples_per_s if isinstance(run, RunConfig) else run.rate_on(profile)


def fit_profile(profile: HardwareProfile, cfgs: dict, measured: dict[str, Measured],
                tune_dir: Path) -> tuple[HardwareProfile, str]:
    """The profile recalibrated to the measured runs (`cfgs`: run id -> its RunConfig, or the tune
    candidate, Echo's or a model card's): a multiplier on its compute factor (in_step) and one on
    its collectives' bus bandwidth, those that minimise the squared log error of the predicted
    samples/s (Nelder-Mead over both logs; the bandwidth held at 1 where no measured run
    communicates), saved FITTED beside the shipped profile as TUNE/profile-tuned.yaml."""
    runs = [(cfgs[rid], m.samples_per_s) for rid, m in measured.items() if m.ok and rid in cfgs]
    base = profile.in_step.factor if profile.in_step else 1.0

    def loss(log_m: float, log_k: float) -> float:
        prof = scaled(profile, math.exp(log_m), math.exp(log_k))
        return sum(math.log(_rate(run, prof) / sps) ** 2 for run, sps in runs)

    from scipy.optimize import minimize, minimize_scalar  # lazy: scipy's import time, for the fit alone

    m_range = (math.log(FIT_BOUNDS[0] / base), math.log(FIT_BOUNDS[1] / base))
    k_range = (math.log(1e-3), math.log(1e3))
    if loss(0.0, k_range[0]) != loss(0.0, k_range[1]):  # some measured run communicates
        log_m, log_k = minimize(lambda x: loss(*x), [0.0, 0.0], method="Nelder-Mead", bounds=[m_range, k_range],
                                options={"xatol": 1e-4, "fatol": 1e-12, "maxiter": 400}).x
    else:
        log_m, log_k = minimize_scalar(lambda x: loss(x, 0.0), bounds=m_range, method="bounded").x, 0.0
    m, k = math.exp(log_m), math.exp(log_k)
    rms = math.sqrt(loss(log_m, log_k) / len(runs))
    before = math.sqrt(loss(0.0, 0.0) / len(runs))
    ids = [rid for rid in measured if rid in cfgs]
    source = (f"FITTED by echobench tune on {now_iso()} to {len(runs)} measured runs in {tune_dir}: compute x {m:.3g}, "
              f"collective bandwidth x {k:.3g} (rms log error of their samples/s {before:.1%} -> {rms:.1%}); "
              f"{profile.name}'s compute factor was {_factor(profile):.3g}")
    fitted = scaled(profile, m, k, "FITTED by echobench tune").model_copy(update={
        "name": f"{profile.name}-tuned", "note": f"{profile.name} recalibrated by echobench tune: {source}"})
    fitted = fitted.model_copy(update={"in_step": fitted.in_step.model_copy(update={"fitted_on": ids, "source": source})
                                       if fitted.in_step else None})
    save_profile(fitted, tune_dir / "profile-tuned.yaml")
    return fitted, (f"{profile.name} recalibrated to {len(runs)} measured runs: compute x {m:.3g}, collective "
                    f"bandwidth x {k:.3g}, FITTED (rms log error {before:.1%} -> {rms:.1%}) -> "
                    f"{tune_dir / 'profile-tuned.yaml'}")


def rerank(problems: Sequence[Problem], profile: HardwareProfile) -> None:
    for p in problems:
        for c in p.candidates:
            if c.prediction is not None:
                c.prediction = c.priced(profile)


# ---- the loop ----

def measured_winner(problem: Problem, measured: dict[str, Measured]) -> Candidate | None:
    ok = [c for c in problem.measurable if (m := measured.get(c.run_id)) is not None and m.ok]
    return max(ok, key=lambda c: measured[c.run_id].samples_per_s, default=None)


def next_picks(problem: Problem, measured: dict[str, Measured], top_k: int) -> list[Candidate]:
    """After a round: the unmeasured candidates the current ranking puts above the measured winner
    (all of them unmeasured where nothing ran ok), ties with a measured one left out, at most K."""
    winner = measured_winner(problem, measured)
    ranked = problem.measurable
    above = ranked[:ranked.index(winner)] if winner is not None else ranked
    out: list[Candidate] = []
    done = [c for c in ranked if c.run_id in measured]
    for c in above:
        if len(out) == top_k:
            break
        if c.run_id not in measured and not any(tied(c, d) for d in done + out):
            out.append(c)
    return out


def run_tune(spec: TuneFile, problems: list[Problem], profile: HardwareProfile, measure: MeasureFn,
             tune_dir: Path, info: dict | None = None, log: Callable[[str], None] = lambda s: None,
             executor: str | None = None, prior_charges: dict[str, float] | None = None) -> TuneResult:
    """Measure, hold, recalibrate, re-rank (the module's docstring) until every problem stops.
    `problems`: Echo's (space.Problem) and a model card's (cards.CardProblem: its measurable layouts
    picked, measured and held alike). `prior_charges`: the device-hours an earlier tune in this
    directory charged its runs."""
    prior = prior_charges or {}
    result = TuneResult(problems, profile, profile, {})
    result.shipped_predictions = {c.run_id: c.samples_per_s for p in problems for c in p.ranked}
    cfgs = {c.run_id: c for p in problems for c in p.measurable}
    slurm = (executor or spec.executor) == "slurm"
    for number in range(1, spec.max_rounds + 1):
        todo: list[Candidate] = []
        for p in problems:
            if p.key in result.stops:
                continue
            if not p.measurable:
                result.stops[p.key] = "none of its ranked layouts can be measured (each one's reason in the output)"
                continue
            chosen = picks(p.measurable, spec.top_k) if number == 1 else next_picks(p, result.measured, spec.top_k)
            chosen = [c for c in chosen if c.run_id not in result.measured]
            if not chosen:
                result.stops[p.key] = "every candidate predicted above the measured winner is measured"
                continue
            todo += chosen
        if not todo:
            break
        if spec.budget_gpu_hours is not None and result.device_hours >= spec.budget_gpu_hours:
            for p in problems:
                result.stops.setdefault(p.key, f"budget spent: {result.device_hours:.3g} of "
                                               f"{spec.budget_gpu_hours:g} device-hours")
            break
        log(f"round {number}: measuring {len(todo)} candidates on {result.profile.name}'s ranking")
        rnd = Round(number, result.profile.name, [c.run_id for c in todo])
        try:
            got = measure(todo)
        except KeyboardInterrupt:
            result.interrupted = True
            result.rounds.append(rnd)
            return result
        if info:
            rnd.wall_s, rnd.exit_code = info.get("wall_s", 0.0), info.get("exit_code", 0)
        # Devices held: on SLURM every run at once (at most slurm.max_submitted of them), an upper
        # bound; the local executor runs one at a time.
        worlds = sorted((c.cfg.world_size for c in todo), reverse=True)
        at_once = (spec.slurm.get("max_submitted") or len(worlds)) if slurm else 1
        rnd.device_hours = rnd.wall_s * sum(worlds[:at_once]) / 3600
        # The round's time goes to the runs it measured that an earlier tune here had not (those keep
        # their charge); a round that measured nothing new keeps its time under its own name.
        new = [rid for rid in got if rid not in prior] or [f"(round {number}: nothing new measured)"]
        result.charges.update({rid: prior[rid] for rid in got if rid in prior})
        result.charges.update({rid: rnd.device_hours / len(new) for rid in new})
        result.rounds.append(rnd)
        result.measured.update(got)
        if rnd.exit_code == 130:
            result.interrupted = True
            return result
        # The model is off: by a common factor, or in the order of what it measured. Refitted from
        # the shipped profile to every run measured so far.
        if consistent_bias(residuals(problems, result.measured), spec.bias) or misranked(problems, result.measured):
            result.profile, result.fit_note = fit_profile(profile, cfgs, result.measured, tune_dir)
            rerank(problems, result.profile)
            log(result.fit_note)
        for p in problems:
            winner = measured_winner(p, result.measured)
            if p.key not in result.stops and winner is not None and p.measurable[0].run_id == winner.run_id:
                result.stops[p.key] = "the measured winner is the predicted winner"
    for p in problems:
        result.stops.setdefault(p.key, f"{spec.max_rounds} rounds measured (max_rounds)")
    return result
