"""What a tune leaves: TUNE/tune.json (every candidate, pruned or predicted, and what was measured),
TUNE/report.md, and per scale and node count the measured winner as a `run --config` file and a
one-run matrix (TUNE/winners/). The dashboard's tune section reads tune.json (echobench.report)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import yaml
from rich.table import Table

from echobench.records.atomic import write_json_atomic
from echobench.records.console import esc
from echobench.records.layout import Layout
from echobench.records.results import now_iso, slower_p_value
from echobench.records.paths import TUNE_FILE
from echobench.records.states import RunState
from echobench.tune.cards import CardProblem, card_entry
from echobench.tune.loop import TuneResult, kendall_tau, measured_winner
from echobench.tune.space import Candidate, Problem, TuneFile, cluster_sections

SCHEMA = 1


def interval(c: Candidate) -> tuple[float, float]:
    """The predicted samples/s interval: the cross-validated model error (predict.intervals) and the
    calibration's spread, whichever is wider (Prediction.step_time_low_s / _high_s)."""
    p = c.prediction
    batch = c.cfg.global_batch
    return batch / p.step_time_high_s, batch / p.step_time_low_s


def stem(problem: Problem) -> str:
    return f"{problem.scale}-n{problem.nodes}x{problem.gpus_per_node}"


def run_settings(spec: TuneFile, c: Candidate) -> dict:
    """The winner's settings for `run --config`: the tune file's defaults and the candidate's own,
    but the process layout (nodes, gpus_per_node: --nnodes / --nproc)."""
    out = {**spec.defaults, **c.settings}
    for key in ("nodes", "gpus_per_node"):
        out.pop(key, None)
    return out


def write_winner(spec: TuneFile, problem: Problem, c: Candidate, tune_dir: Path) -> dict[str, str]:
    """TUNE/winners/STEM.yaml (`echobench run --config`) and STEM-matrix.yaml (`echobench sweep`)."""
    folder = tune_dir / "winners"
    folder.mkdir(parents=True, exist_ok=True)
    config, matrix = folder / f"{stem(problem)}.yaml", folder / f"{stem(problem)}-matrix.yaml"
    launch = "" if c.cfg.world_size == 1 else f" --nproc {c.cfg.gpus_per_node}" + (
        f" --nnodes {c.cfg.nodes} --node-rank K --master-addr HOST" if c.cfg.nodes > 1 else "")
    config.write_text(f"# {spec.name}: the measured winner of {problem.key} ({c.run_id}), by echobench tune.\n"
                      f"#   echobench run --config {config.name}{launch} --out OUT\n"
                      + yaml.safe_dump(run_settings(spec, c), sort_keys=False))
    doc = {"name": f"{spec.name}-{stem(problem)}-winner", **cluster_sections(spec, folder),
           "defaults": {**spec.defaults, **c.settings}}
    matrix.write_text(f"# {spec.name}: the measured winner of {problem.key} ({c.run_id}) as a one-run matrix.\n"
                      f"#   echobench sweep {matrix.name} --out runs/{doc['name']}\n"
                      + yaml.safe_dump(doc, sort_keys=False))
    return {"config": str(config), "matrix": str(matrix)}


def candidate_entry(c: Candidate, rank: int, result: TuneResult) -> dict:
    low, high = interval(c)
    m = result.measured.get(c.run_id)
    p = c.prediction
    return {"run_id": c.run_id, "family": c.family, "rank": rank, "settings": c.settings,
            "predicted": {"samples_per_s": p.samples_per_s, "samples_per_s_low": low, "samples_per_s_high": high,
                          "step_time_s": p.step_time_s, "mfu": p.mfu, "memory_gib": p.memory_gib},
            "shipped_samples_per_s": result.shipped_predictions.get(c.run_id),
            "measured": None if m is None else {"status": m.status, "samples_per_s": m.samples_per_s,
                                                 "step_time_s": m.step_time_s, "mfu": m.mfu,
                                                 "peak_mem_gib": m.peak_mem_gib, "error": m.error},
            "residual": (m.samples_per_s / p.samples_per_s - 1) if m is not None and m.ok else None,
            "round": next((r.number for r in result.rounds if c.run_id in r.run_ids), None)}


def taus(problem: Problem, result: TuneResult) -> dict[str, float | None]:
    """Kendall's tau of predicted vs measured samples/s over the measured candidates: on the
    shipped profile and on the final one."""
    ok = [c for c in problem.ranked if (m := result.measured.get(c.run_id)) is not None and m.ok]
    measured = [result.measured[c.run_id].samples_per_s for c in ok]
    return {"shipped": kendall_tau([result.shipped_predictions[c.run_id] for c in ok], measured),
            "final": kendall_tau([c.prediction.samples_per_s for c in ok], measured), "runs": len(ok)}


NOISE_ALPHA = 0.05  # a measured candidate not slower than the winner at this level ties with it


def ties(problem: Problem, result: TuneResult, winner: Candidate | None) -> list[dict]:
    """The measured candidates the measurements cannot tell from the winner: their step times per
    sample are not significantly slower than the winner's (one-sided Mann-Whitney U, p >= NOISE_ALPHA)."""
    if winner is None or not (best := result.measured[winner.run_id]).step_times_s:
        return []
    out = []
    for c in problem.ranked:
        m = result.measured.get(c.run_id)
        if c is winner or m is None or not m.ok or not m.step_times_s:
            continue
        p = slower_p_value([t / winner.cfg.global_batch for t in best.step_times_s],
                           [t / c.cfg.global_batch for t in m.step_times_s])
        if p >= NOISE_ALPHA:
            out.append({"run_id": c.run_id, "p": p})
    return out


def problem_entry(spec: TuneFile, problem: Problem, result: TuneResult, tune_dir: Path) -> dict:
    winner = measured_winner(problem, result.measured)
    ranked = problem.ranked
    reasons = Counter(c.pruned.split(":")[0] for c in problem.pruned)
    return {"key": problem.key, "scale": problem.scale, "nodes": problem.nodes,
            "gpus_per_node": problem.gpus_per_node, "capacity_gib": problem.capacity_gib,
            "capacity_source": problem.capacity_source, "stop": result.stops.get(problem.key),
            "winner": winner.run_id if winner else None, "predicted_winner": ranked[0].run_id,
            "kendall_tau": taus(problem, result), "ties": ties(problem, result, winner),
            "files": write_winner(spec, problem, winner, tune_dir) if winner else {},
            "candidates": [candidate_entry(c, i + 1, result) for i, c in enumerate(ranked)],
            "pruned_counts": dict(reasons),
            "pruned": [{"run_id": c.run_id, "settings": c.settings, "reason": c.pruned} for c in problem.pruned]}


def prior_charges(tune_dir: Path) -> dict[str, float]:
    """The device-hours an earlier tune in this directory charged its runs (none where there was no
    readable tune.json)."""
    try:
        charges = json.loads((tune_dir / TUNE_FILE).read_text()).get("charges", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: float(v) for k, v in charges.items() if isinstance(v, (int, float))} if isinstance(charges, dict) else {}


def write_outputs(spec: TuneFile, tune_file: Path, result: TuneResult, tune_dir: Path) -> dict:
    """tune.json, the winners' files and report.md; returns tune.json's content. A model card's
    problems (echobench.tune.cards) are under `cards` (cards.card_entry)."""
    doc = {"schema": SCHEMA, "name": spec.name, "tune_file": str(tune_file), "date": now_iso(),
           "executor": spec.executor, "top_k": spec.top_k, "budget_gpu_hours": spec.budget_gpu_hours,
           "device_hours": result.device_hours, "interrupted": result.interrupted,
           "profile": {"shipped": result.shipped.name, "final": result.profile.name, "fit_note": result.fit_note,
                       "fitted_file": str(tune_dir / "profile-tuned.yaml") if result.fit_note else None},
           "rounds": [vars(r) for r in result.rounds], "charges": result.charges,
           "problems": [problem_entry(spec, p, result, tune_dir) for p in result.problems if isinstance(p, Problem)],
           "cards": [card_entry(p, result) for p in result.problems if isinstance(p, CardProblem)]}
    write_json_atomic(tune_dir / TUNE_FILE, doc)
    (tune_dir / "report.md").write_text(report_markdown(doc))
    return doc


# ---- the report ----

def _num(v, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def _settings_text(settings: dict) -> str:
    """A candidate's searched settings, short: "mb 8, accum 2, ac full, compiled, no reshard, bf16"."""
    parts = [f"mb {settings['micro_batch']}"]
    if (settings.get("grad_accum") or 1) > 1:
        parts.append(f"accum {settings['grad_accum']}")
    parts += [f"ac {settings['ac']}", "compiled" if settings["compile"] is True else "eager"]
    if Layout.parse(settings["parallelism"]).shards_parameters and not settings["reshard_after_forward"]:
        parts.append("no reshard")
    return ", ".join([*parts, settings["precision"]])


def _md(text) -> str:  # a table cell: the pipe would end it
    return str(text).replace("|", "\\|")


def report_markdown(doc: dict) -> str:
    lines = [f"# Tune {doc['name']}", "",
             f"Tune file {doc['tune_file']}, {doc['date']}; executor {doc['executor']}; top K {doc['top_k']} plus the "
             f"best of each layout family; ranked on {doc['profile']['shipped']}"
             + (f", re-ranked on {doc['profile']['final']} ({doc['profile']['fit_note']})" if doc["profile"]["fit_note"]
                else "") + f"; {doc['device_hours']:.3g} device-hours measured"
             + (f" of a budget of {doc['budget_gpu_hours']:g}" if doc["budget_gpu_hours"] else "") + ".", ""]
    if doc["interrupted"]:
        lines += ["**Interrupted**: the same `echobench tune` resumes (measured runs are kept).", ""]
    for p in doc["problems"]:  # Echo: measured
        win = next((c for c in p["candidates"] if c["run_id"] == p["winner"]), None)
        lines += [f"## {p['scale']} on {p['nodes']} node(s) x {p['gpus_per_node']}", ""]
        if win:
            lines += [f"**Measured winner:** {win['run_id']} ({win['family']}; {_settings_text(win['settings'])}): "
                      f"{win['measured']['samples_per_s']:.4g} samples/s measured, {win['predicted']['samples_per_s']:.4g} "
                      f"predicted (rank {win['rank']}). Files: {p['files']['config']} (`echobench run --config`), "
                      f"{p['files']['matrix']} (`echobench sweep`).", ""]
        else:
            lines += ["**No measured winner**: no picked candidate ran ok.", ""]
        if p["ties"]:
            lines += ["Within measurement noise of the winner (its step times per sample not significantly faster: "
                      f"one-sided Mann-Whitney U, p >= {NOISE_ALPHA}): "
                      + ", ".join(f"{t['run_id']} (p = {t['p']:.2f})" for t in p["ties"]) + ".", ""]
        tau = p["kendall_tau"]
        lines += [f"Predicted winner: {p['predicted_winner']}. Stopped: {p['stop']}. Kendall's tau of predicted vs "
                  f"measured samples/s over {tau['runs']} measured runs: {_num(tau['shipped'], '.2f')} on the shipped "
                  f"profile, {_num(tau['final'], '.2f')} on the final one.", "",
                  "| rank | run | family | settings | predicted samples/s [interval] | measured | residual | round |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in p["candidates"]:
            if c["measured"] is None:
                continue
            pr, m = c["predicted"], c["measured"]
            got = (_num(m["samples_per_s"], ".4g") if m["status"] == RunState.OK
                   else f"{m['status']}: {_md(m['error'])[:80]}")
            lines.append(f"| {c['rank']} | {c['run_id']} | {c['family']} | {_md(_settings_text(c['settings']))} | "
                         f"{pr['samples_per_s']:.4g} [{pr['samples_per_s_low']:.4g}, {pr['samples_per_s_high']:.4g}] | "
                         f"{got} | {_num(c['residual'], '+.1%')} | {c['round']} |")
        lines += ["", f"{len(p['candidates'])} candidates ranked, {sum(p['pruned_counts'].values())} pruned "
                      f"(device memory {_num(p['capacity_gib'], '.1f')} GiB: {p['capacity_source']})"
                      + (":" if p["pruned"] else "."), ""]
        for reason, n in Counter(x["reason"] for x in p["pruned"]).most_common():
            lines.append(f"- {n} x {reason}")
        lines.append("")
    for p in doc["cards"]:  # a model card: its measurable picks measured as card runs
        win = next((c for c in p["candidates"] if c["name"] == p["winner"]), None)
        tau = p["kendall_tau"]
        lines += [f"## Model card {p['card']} on {p['nodes']} node(s) x {p['gpus_per_node']}", "",
                  (f"**Measured winner:** {win['name']} (run {win['run_id']}): {win['measured']['samples_per_s']:.4g} "
                   f"samples/s measured (step {win['measured']['step_time_s']:.4g} s), {win['samples_per_s']:.4g} "
                   f"predicted (step {win['step_time_s']:.4g} s; rank {win['rank']})." if win else
                   "**No measured winner**: " + ("no picked layout ran ok." if any(c["measured"] for c in p["candidates"])
                                                   else "nothing measured.")), "",
                  f"Ranked on {p['profile']} (predict_card). Predicted winner: {p['predicted_winner']}"
                  + ("" if p["predicted_measurable_winner"] == p["predicted_winner"] else
                     f" (ranked only; the best measurable: {p['predicted_measurable_winner']})"
                     if p["predicted_measurable_winner"] else " (ranked only, as every layout here)")
                  + f". Stopped: {p['stop']}. Kendall's tau of predicted vs measured samples/s over {tau['runs']} "
                  f"measured runs: {_num(tau['shipped'], '.2f')} on the shipped profile, {_num(tau['final'], '.2f')} "
                  f"on the final one. {len(p['candidates'])} layouts ranked, {len(p['pruned'])} pruned (device memory "
                  f"{_num(p['capacity_gib'], '.1f')} GiB).", "",
                  "| rank | layout | family | grad_accum | memory GiB | predicted samples/s (step s) | tokens/s | MFU | "
                  "measured samples/s (step s) | residual | round |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in p["candidates"]:
            m = c["measured"]
            if c["rank"] > 15 and m is None:
                continue
            got = ("-" if m is None
                   else f"{m['samples_per_s']:.4g} ({m['step_time_s']:.4g})" if m["status"] == RunState.OK
                   else f"{m['status']}: {_md(m['error'])[:80]}")
            lines.append(f"| {c['rank']} | {c['name']} | {c['family']} | {c['grad_accum']} | {c['memory_gib']:.1f} | "
                         f"{c['samples_per_s']:.4g} ({c['step_time_s']:.4g}) | {c['tokens_per_s']:.4g} | {c['mfu']:.1%} | "
                         f"{got} | {_num(c['residual'], '+.1%')} | {_num(c['round'], 'd')} |")
        lines.append("")
        for reason, n in Counter(c["unmeasured"] for c in p["candidates"] if c["unmeasured"]).most_common():
            lines.append(f"- {n} x ranked only, not measured: {_md(reason)}")
        for reason, n in Counter(x["reason"] for x in p["pruned"]).most_common():
            lines.append(f"- {n} x {reason}")
        lines.append("")
    lines += ["## Rounds", "", "| round | profile | runs | wall s | device-hours | sweep exit |", "|---|---|---|---|---|---|"]
    for r in doc["rounds"]:
        lines.append(f"| {r['number']} | {r['profile']} | {len(r['run_ids'])} | {r['wall_s']:.0f} | "
                     f"{r['device_hours']:.3g} | {r['exit_code']} |")
    return "\n".join(lines) + "\n"


def ranking_table(problem: Problem, result: TuneResult, rows: int = 10) -> Table:
    """The console's view of a problem: the top of the ranking and every measured candidate."""
    t = Table(title=f"{esc(problem.key)}: {len(problem.ranked)} ranked, {len(problem.pruned)} pruned", title_justify="left")
    for col in ("rank", "run", "family", "settings", "pred samples/s [interval]", "measured", "resid"):
        t.add_column(col, justify="right" if col in ("rank", "measured", "resid") else "left")
    for i, c in enumerate(problem.ranked):
        m = result.measured.get(c.run_id)
        if i >= rows and m is None:
            continue
        low, high = interval(c)
        got = "" if m is None else (f"{m.samples_per_s:.4g}" if m.ok else m.status)
        res = f"{m.samples_per_s / c.prediction.samples_per_s - 1:+.1%}" if m is not None and m.ok else ""
        t.add_row(str(i + 1), esc(c.run_id), c.family, esc(_settings_text(c.settings)),
                  f"{c.prediction.samples_per_s:.4g} [{low:.4g}, {high:.4g}]", got, res)
    return t
