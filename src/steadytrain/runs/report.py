"""``steadytrain report RUN``: a run's plots and its ``summary.md``.

The summary states what a person needs to judge the run at a glance: the batch plan (effective
batch = micro x accumulation x world, the scaled LR and its rule), how many steps ran, were skipped
and clipped, the environment in one paragraph, the final loss and, when the run recorded layer norms,
the layers with the largest updates and any that never received a gradient, with the plots embedded.
A mixture run (``sources.json``) gets a plot of each source's loss, one of the realized mixture against its
plan, and a table of its sources (:mod:`.mixture`, :mod:`.mixplots`).
A plot that cannot be drawn is named in the summary; the rest of the report is still written.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain._io import load_json, one_line, present, write_text_atomic
from steadytrain._text import error_text, md, short
from steadytrain.errors import UserError
from steadytrain.rundir.layout import running_by
from steadytrain.rundir.schema import check_nonfinite_report
from steadytrain.runs import layerplot, mixplots, mixture, plots
from steadytrain.runs.goodplot import goodput_plot
from steadytrain.runs.goodput import GOODPUT_FILE, Account, goodput, goodput_sentence, write_goodput
from steadytrain.runs.record import RunRecord, load_run, shown, smooth
from steadytrain.train.observe.figures import describe, summarize

if TYPE_CHECKING:
    from steadytrain.data.sourcemap import SourceMap

__all__ = ["PLOTS", "Report", "environment_paragraph", "plan_sentence", "report", "report_after_training"]

log = logging.getLogger("steadytrain.runs")

PLOTS = {
    "loss": plots.loss_plot,
    "lr": plots.lr_plot,
    "grad_norm": plots.grad_norm_plot,
    "throughput": plots.throughput_plot,
    "layers": layerplot.layers_plot,
}
"""Plot name (``plots/<name>.png``) -> the function that draws it (and returns its path, or None when the run has
nothing to draw there: ``layers`` without ``layers.jsonl``). A mixture run draws :func:`.mixplots.plots_for` too."""


@dataclass
class Report:
    """What :func:`report` wrote."""

    summary: Path
    plots: dict[str, Path] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Plots that could not be drawn, with the reason (the summary says so too)."""
    goodput: Account | None = None
    """The run's time account (``goodput.json``, written here), or None when it has no ``timeline.jsonl``."""


def report(run: str | Path, *, stopped: str | None = None) -> Report:
    """Write ``RUN/plots/*.png`` and ``RUN/summary.md``.

    Args:
        run: a run directory.
        stopped: why training stopped early, when the caller knows (``train`` passes it).

    Raises:
        UserError: not a run directory, or a malformed file in it (names the file; a damaged ``sources.json``
            before anything is written).

    Example:
        >>> from steadytrain.runs import report
        >>> report("runs/default").summary  # doctest: +SKIP
        PosixPath('runs/default/summary.md')
    """
    rec = load_run(run)
    sources = mixture.load_mixture(rec)
    out = Report(summary=rec.run.summary)
    where = _plots_dir(rec)
    out.goodput = _goodput(rec, out)
    if out.goodput is not None:
        _draw(out, "goodput", lambda path: goodput_plot(out.goodput, rec.name, path), where / "goodput.png")
    for name, draw in {**PLOTS, **(mixplots.plots_for(sources) if sources else {})}.items():
        _draw(out, name, lambda path, draw=draw: draw(rec, path), where / f"{name}.png")
    write_text_atomic(out.summary, summary_markdown(rec, out, stopped, sources))
    return out


def _draw(out: Report, name: str, draw: Any, path: Path) -> None:
    """One plot into ``out`` (drawn, or failed with the reason)."""
    try:
        drawn = draw(path)
        if drawn is not None:
            out.plots[name] = drawn
    except UserError:  # the directory is not writable, a name there is not a file: the summary fails too
        raise
    except Exception as err:  # a plot is never worth losing the report (or the run) over
        out.failed[name] = f"{type(err).__name__}: {error_text(err)}"
        log.warning("%s: could not draw the %s plot: %s", out.summary.parent, name, out.failed[name])


def _goodput(rec: RunRecord, out: Report) -> Account | None:
    """The run's account, written to ``goodput.json``; None without ``timeline.jsonl`` (a run from before it, or
    an own loop's run): a timeline that cannot be read is named in the summary, the rest is still written. A
    ``goodput.json`` that cannot be written (a directory of that name) is the account's first note: the summary
    and the plot still show it."""
    if not present(rec.run.path / "timeline.jsonl"):
        return None
    try:
        account = goodput(rec.run.path)
    except UserError as err:
        out.failed["goodput"] = error_text(err)
        log.warning("%s: no time account: %s", rec.run.path, out.failed["goodput"])
        return None
    try:
        write_goodput(rec.run.path, account)
    except UserError as err:
        account.notes.insert(0, f"{GOODPUT_FILE} was not written: {error_text(err)}")
        log.warning("%s: %s", rec.run.path, account.notes[0])
    return account


def _goodput_line(account: Account) -> str:
    """The summary's first line: the account's sentence, and its notes' number and first one (lines left out of
    a damaged timeline, a ``goodput.json`` not written)."""
    n = len(account.notes)
    notes = f"; {n} note{'s' if n != 1 else ''}, the first: {short(account.notes[0], 200)}" if n else ""
    return f"- **{md(goodput_sentence(account))}** (`steadytrain goodput RUN` for the causes{md(notes)})"


def report_after_training(run: str | Path, stopped: str | None = None) -> Report | None:
    """:func:`report` at the end of ``steadytrain train`` (rank 0): a failure only warns, leaving the
    short summary the run wrote in place: a picture is never worth losing a run over."""
    try:
        return report(run, stopped=stopped)
    except Exception as err:
        log.warning("%s: the report (plots, summary.md) was not written: %s: %s", run, type(err).__name__, err)
        return None


def _plots_dir(rec: RunRecord) -> Path:
    """``RUN/plots``, created when absent; a file of that name is one error, not four failed plots."""
    path = rec.run.path / "plots"
    try:
        path.mkdir(exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path}: is not a directory: move it away so the report can write its plots there") from None
    except OSError as err:
        raise UserError(f"{path}: cannot create the plots directory ({err.strerror or err})") from None
    return path


def plan_sentence(plan: dict[str, Any]) -> str:
    """``effective batch 64 = micro 16 × accumulation 4 × world 1; peak LR 0.003 (linear rule ...)``."""
    if not plan:
        return "no batch plan recorded (plan.json is missing)"
    text = (
        f"effective batch {_value(plan.get('global_batch_size'))} = micro {_value(plan.get('micro_batch_size'))} × "
        f"accumulation {_value(plan.get('accumulation_steps'))} × world {_value(plan.get('world_size'))}; "
        f"peak LR {_value(plan.get('lr'))}"
    )
    base, rule = plan.get("base_batch_size"), plan.get("scaling_rule")
    if base and plan.get("global_batch_size"):
        k = plan["global_batch_size"] / base
        text += f" ({one_line(rule)} rule: base LR {_value(plan.get('base_lr'))} at batch {base}, scale-up ×{k:g})"
    else:
        text += " (unscaled: no base batch size)"
    return text


def _stats(rec: RunRecord) -> dict[str, Any]:
    loss = plots.applied_losses(rec)
    rates = [r for r in rec.column("items_per_s")[1:] if r] or [r for r in rec.column("items_per_s") if r]
    last = rec.metrics[-1] if rec.metrics else {}
    applied = [r for r in rec.metrics if not r.get("skipped")]
    return {
        "steps": last.get("step", 0),
        "skipped": sum(bool(r.get("skipped")) for r in rec.metrics),
        "clipped": sum(bool(r.get("clipped")) for r in rec.metrics),
        "final": applied[-1].get("loss") if applied else None,
        "smoothed": (smooth(loss) or [None])[-1],
        "rate": statistics.median(rates) if rates else None,
        "elapsed": last.get("elapsed_s"),
    }


def _fmt(x: Any, spec: str = ".4g") -> str:
    return "n/a (not finite)" if x is None else format(x, spec)


def _value(x: Any) -> str:
    """A number of the plan (a count in full, a rate to 4 digits); ``?`` for one the plan does not record."""
    return "?" if x is None else str(x) if isinstance(x, int) else format(x, ".4g")


def _stopped_line(rec: RunRecord, stopped: str | None, steps: int) -> str | None:
    total = rec.plan.get("total_steps")
    if stopped:
        return f"stopped early: {md(stopped)}"
    if rec.evals and rec.evals[-1].get("early_stop"):  # the row of the evaluation that ended the run
        patience = (rec.config.get("eval") or {}).get("patience")
        best = plots.best_eval(rec)
        since = f"; best {_fmt(best['val_loss'])} at step {best['step']}" if best else ""
        return (
            f"stopped early: early stopping at step {rec.evals[-1]['step']}: the validation loss had not improved "
            f"for {_value(patience)} evaluation(s) (eval.patience={_value(patience)}{since})"
        )
    if total and steps < total:
        if (who := running_by(rec.run.path)) is not None:  # report of a run still training: not an early stop
            return f"running: {steps} of {total} planned optimizer steps so far (written by {md(short(who))})"
        return f"stopped early: {steps} of {total} planned optimizer steps ran"
    return None


def _nonfinite_line(rec: RunRecord) -> str | None:
    path = rec.run.path / "nonfinite_report.json"
    if not present(path):
        return None
    sentence = check_nonfinite_report(load_json(path, what="non-finite report"), str(path))
    return f"non-finite steps: {md(sentence)} (`nonfinite_report.json`)" if sentence else None


def _spike_rows(rec: RunRecord) -> list[tuple[str, str]]:
    """Loss spikes and rollbacks, counted (with the run's policy); nothing when spikes were not watched."""
    policy = (rec.config.get("spike") or {}).get("policy")
    if not rec.spikes and not rec.rollbacks and policy in (None, "off"):
        return []
    text = f"{len(rec.spikes)} (spike.policy={md(str(policy))})"
    if rec.rollbacks:
        text += f"; {len(rec.rollbacks)} rollback(s): " + ", ".join(
            f"step {r['step']} to {r['rollback_to']}" for r in rec.rollbacks[:5]
        )
    return [("loss spikes", text)]


def _spike_line(rec: RunRecord) -> str | None:
    """The spike report's sentence (``steadytrain spikes report``), when the run had spikes."""
    if not rec.spikes:
        return None
    from steadytrain.diagnose import report
    from steadytrain.diagnose.ledger import SPIKES

    return f"loss spikes: {md(report(rec.run.path, SPIKES).sentence)} (`spikes.jsonl`)"


def summary_markdown(rec: RunRecord, rep: Report, stopped: str | None, sources: SourceMap | None = None) -> str:
    """The text of ``summary.md``: every value a user controls (names, config, provenance, messages) goes through
    :func:`~steadytrain._text.md`; the table holds numbers this function formats. ``sources``: a mixture run's
    (:func:`.mixture.load_mixture`), for its table of sources."""
    s = _stats(rec)
    threshold = (rec.config.get("clip") or {}).get("max_grad_norm")
    rows = [
        ("optimizer steps", f"{s['steps']} of {_value(rec.plan.get('total_steps'))} planned"),
        (
            "skipped (non-finite) steps",
            str(s["skipped"] - sum(1 for r in rec.metrics if r.get("spike") and r.get("skipped"))),
        ),
        *_spike_rows(rec),
        ("clipped steps", f"{s['clipped']}" + (f" (global norm above {threshold:g})" if threshold else "")),
        ("final loss", f"{_fmt(s['final'])} (smoothed {_fmt(s['smoothed'])})"),
        *_validation_rows(rec),
        ("throughput", f"median {_fmt(s['rate'], '.4g')} examples/s" if s["rate"] else "n/a"),
        *([("compute", text)] if (text := describe(summarize(rec.metrics))) else []),
        ("wall time", f"{s['elapsed']:.1f} s" if s["elapsed"] is not None else "n/a"),
    ]
    lines = [f"# Run {md(rec.name)}", ""]
    if rep.goodput is not None:
        lines += [_goodput_line(rep.goodput)]
    lines += [f"- {md(plan_sentence(rec.plan))}", *_schedule_lines(rec)]
    lines += [f"- {x}" for x in (_stopped_line(rec, stopped, s["steps"]), _nonfinite_line(rec), _spike_line(rec)) if x]
    lines += [f"- {x}" for x in _resume_lines(rec)]
    lines += [f"- {x}" for x in _restart_lines(rec)]
    lines += ["", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += mixture.summary_lines(rec, sources) if sources else []
    lines += [f"**Environment.** {md(environment_paragraph(rec.env))}", "", *_layer_lines(rec)]
    for name, path in rep.plots.items():
        lines += [f"![{name}](plots/{path.name})", ""]
    for name, why in rep.failed.items():
        lines += [f"- the {name} plot could not be drawn: {md(why)}"]
    return "\n".join(lines).rstrip() + "\n"


def _layer_lines(rec: RunRecord) -> list[str]:
    """The summary's Layers part (``layers.jsonl``): the largest median update ratios, and each layer that never
    received a gradient, said plainly; nothing when the run recorded no layer norms."""
    from steadytrain.diagnose.layers import largest_update_ratios, latest_layers, read_layers, zero_grad_layers

    rows, since = latest_layers(read_layers(rec.run.path))
    if not rows:
        return []
    top = ", ".join(f"{md(layer)} {value:.3g}" for layer, value in largest_update_ratios(rows))
    changed = f" from step {since} on, where the layers changed (monitor.group changed on a resume?)" if since else ""
    lines = [
        "**Layers.** Largest update ratio ‖Δw‖ / ‖w‖ (median over the monitored steps that applied an update"
        f"{changed}): {top or 'none recorded'} (`layers.jsonl`; `steadytrain layers RUN --step S` shows one step)."
    ]
    frozen = zero_grad_layers(rows)
    if frozen:
        lines += ["", *(f"- layer {md(x)} received no gradient in any monitored step: frozen or disconnected by "
                        "mistake?" for x in frozen)]  # fmt: skip
    return [*lines, ""]


def _validation_rows(rec: RunRecord) -> list[tuple[str, str]]:
    """The summary's validation rows: the best loss and its step, the last one (none without evaluations)."""
    if not rec.evals:
        return []
    best, last = plots.best_eval(rec), rec.evals[-1]
    return [
        ("best validation loss", f"{_fmt(best['val_loss'])} at step {best['step']}" if best else "n/a (not finite)"),
        (
            "final validation loss",
            f"{_fmt(last.get('val_loss'))} at step {last['step']} ({last['val_items']} examples)",
        ),
    ]


def _resume_lines(rec: RunRecord) -> list[str]:
    """One line per resume: the step, the world size and what it changed (``resumes.jsonl``)."""

    def value(v: Any) -> str:
        return md(_value(v) if isinstance(v, int | float) and not isinstance(v, bool) else shown(v))

    out = []
    for r in rec.resumes:
        changed = "; ".join(f"{md(k)} {value(a)} → {value(b)}" for k, (a, b) in r.get("changes", {}).items())
        out.append(f"resumed after step {r['step']} on {r['world_size']} rank(s)" + (f": {changed}" if changed else ""))
    return out


def _restart_lines(rec: RunRecord) -> list[str]:
    """How many times the run restarted on its own (``--auto-resume``), the time it cost, and why."""
    from steadytrain.runs.hangs import read_restarts

    rows = read_restarts(rec.run)
    if not rows:
        return []
    lost = sum(r["lost_s"] for r in rows)  # checked as it was read: a finite number >= 0
    why = "; ".join(f"step {r['step']}: {md(shown(r['reason']))}" for r in rows)
    return [f"restarted {len(rows)} time(s), {lost:.1f} s lost (`restarts.jsonl`): {why}"]


def _schedule_lines(rec: RunRecord) -> list[str]:
    batch, plan = rec.config.get("batch") or {}, rec.plan
    if plan.get("warmup_steps") is None:
        return []
    text = (
        f"warmup {plan['warmup_steps']} optimizer step(s), then {batch.get('decay', 'cosine')} decay to "
        f"{batch.get('min_lr_ratio', 0):g} × peak; seed {(rec.config.get('run') or {}).get('seed')}"
    )
    return [f"- {md(text)}"]


def environment_paragraph(env: dict[str, Any] | None) -> str:
    """The environment in one paragraph: image (tag, or torch/CUDA/Python/OS), host (driver, kernel, devices), code."""
    if not env:
        return "Not recorded (env.json is missing)."
    image, host, code = env.get("image") or {}, env.get("host") or {}, env.get("code") or {}
    container = host.get("container") or {}
    if container.get("image_tag"):
        img = f"image {container['image_tag']}"
    else:
        os_name = (image.get("os") or {}).get("pretty_name") or "an unknown OS"
        img = (
            f"no image tag recorded: torch {image.get('torch')}, CUDA {image.get('cuda') or 'none'}, cuDNN "
            f"{image.get('cudnn') or 'none'}, Python {image.get('python')} on {os_name}"
        )
    gpus = host.get("gpus") or []
    cpu = host.get("cpu") or {}
    devices = f"{len(gpus)} × {gpus[0].get('name')}" if gpus else f"CPU {cpu.get('model')} ({cpu.get('count')} cores)"
    driver = host.get("nvidia_driver") or "none (no NVIDIA GPU)"
    commit = code.get("git_commit")
    dirty = " with uncommitted changes" if code.get("git_dirty") else ""
    src = f"commit {commit[:12]}{dirty}" if commit else "no git"
    text = f"{img[0].upper()}{img[1:]}; host: NVIDIA driver {driver}, kernel {host.get('kernel')}"
    return one_line(f"{text}, {devices}; code: {src}.")
