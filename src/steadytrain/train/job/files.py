"""What a run writes besides checkpoints: config, plan, environment, ledger, exposure, summary.

Rank 0 writes the shared files; every rank appends its own non-finite events. Decisions that
could differ by rank (the run directory exists, the contract fails) are agreed over all ranks
first, so every rank stops with the same one-line error instead of some waiting forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain._io import load_json, present, rewrite_jsonl, write_text_atomic
from steadytrain._text import md
from steadytrain._yamlio import load_yaml
from steadytrain.data.sourcemap import SOURCES_FILE, SourceMap, mixture_fingerprint
from steadytrain.errors import UserError
from steadytrain.rundir.hangs import read_restarts
from steadytrain.rundir.layout import RunDir, claim_run_dir, lock_run, open_run_dir
from steadytrain.rundir.origin import read_origin
from steadytrain.rundir.schema import check_plan, read_metrics, read_resumes
from steadytrain.train.observe.throughput import describe, summarize
from steadytrain.train.setup.config import resolved_config
from steadytrain.train.setup.distributed import DistInfo, agree, barrier, from_main

if TYPE_CHECKING:
    from steadytrain.train.job.core import Job
    from steadytrain.train.setup.config import TrainConfig
    from steadytrain.train.setup.holdout import HeldOut
    from steadytrain.train.setup.pieces import RunPlan

log = logging.getLogger("steadytrain.train")


def prepare(
    cfg: TrainConfig,
    info: DistInfo,
    plan: RunPlan,
    *,
    run_dir: Path | None,
    resume: Path | None,
    data: Path,
    held_out: HeldOut | None = None,
    sources: SourceMap | None = None,
    flag: str = "--resume",
) -> tuple[RunDir, Any, dict[str, list[Any]]]:
    """The run directory, locked by rank 0 for the run's lifetime: claimed new (never overwritten), or
    the one to resume with what the resume changes (refused in one line if it cannot be honoured). A mixture's
    ``sources`` go to ``sources.json``, and ``data.json`` describes each source.

    Returns ``(run, lock, changes)``; ``lock`` is None on other ranks (release it when done).
    """
    from steadytrain.train.checkpoint.catalog import check_latest
    from steadytrain.train.job.resume import RunFinished

    error, lock, changes, finished = None, None, {}, None
    path = Path(resume or run_dir or Path(cfg.run.dir) / cfg.run.name)
    if info.is_main:
        try:
            if resume is not None:
                run = open_run_dir(path)
                if read_origin(run.path) is not None:
                    raise UserError(
                        f"{path}: a run of steadytrain.Run (your own loop), not of steadytrain train: continue it "
                        "with Run(..., resume=True) in your script"
                    )
                check_latest(run.checkpoints)
                lock = lock_run(run, record=False)  # its owner is recorded once the resume's checks pass
                changes = _resume_changes(cfg, plan, run, flag)
            else:
                run = claim_run_dir(path)
                lock = lock_run(run)
                run.write_config(resolved_config(cfg))
                where = str(Path(data).resolve()) if sources is None else None
                run.write_json(run.plan, {**plan.to_dict(), "data": where, **_held(held_out)})
                shards = held_out.shards if held_out else None
                if sources is None:
                    run.write_json(run.data, describe_data(data, held_out=shards, validation=cfg.eval.data))
                else:
                    run.write_json(run.path / SOURCES_FILE, sources.to_dict())
                    run.write_json(run.data, describe_mixture(sources, validation=cfg.eval.data))
        except UserError as err:
            error = str(err)
            finished = err if isinstance(err, RunFinished) else None
            if lock is not None:
                lock.release()
    # only rank 0 touched the run directory: every rank stops with its error (or goes on), none waits forever
    if resume is not None and from_main(info, finished is not None):  # nothing to train: not a failure either
        raise finished or RunFinished("another rank found the run finished (its log says so)")
    agree(info, error)
    return RunDir(path), lock, changes


def check_run_files(run: RunDir, plan: dict[str, Any]) -> None:
    """Before a resume appends to them: every log and record of the run as its readers check them (a
    damaged line is one error naming file and line, never carried on under new rows)."""
    from steadytrain.diagnose import read_exposure, read_ledger
    from steadytrain.diagnose.ledger import SPIKES

    check_plan(plan, str(run.plan))
    read_metrics(run.metrics)
    read_resumes(run.resumes)
    read_restarts(run.restarts)
    read_ledger(run.path)
    read_ledger(run.path, SPIKES)
    read_exposure(run.path)
    for path in (run.layers, run.path / "ranks.jsonl"):  # cut a line at a time: any size, so not read whole here
        rewrite_jsonl(path, None, what=path.name)


def _resume_changes(cfg: TrainConfig, plan: RunPlan, run: RunDir, flag: str) -> dict[str, list[Any]]:
    """What ``cfg`` changes in the run's saved config; a UserError (naming ``flag``, as the user asked for the
    resume) for what a resume cannot honour."""
    from steadytrain.train.checkpoint.catalog import list_checkpoints
    from steadytrain.train.job.resume import config_changes, refuse_changes

    found = list_checkpoints(run.checkpoints)
    if not found:
        raise UserError(f"{run.path}: no checkpoint to resume from (checkpoints/ is empty)")
    saved = load_yaml(run.config, what="run config")
    saved_plan = load_json(run.plan, what="batch plan") if present(run.plan) else {}
    if not isinstance(saved, dict) or not isinstance(saved_plan, dict):
        raise UserError(f"{run.path}: config.yaml or plan.json is not a mapping: the run directory is damaged")
    check_run_files(run, saved_plan)
    changes = config_changes(saved, resolved_config(cfg))
    saved_eval = saved.get("eval") if isinstance(saved.get("eval"), dict) else {}
    evaluated = any(saved_eval.get(k) is not None for k in ("data", "holdout_shards", "holdout_fraction"))
    refuse_changes(changes, saved_plan, plan.to_dict(), found[-1][0], str(run.path), evaluated=evaluated, flag=flag)
    return changes


def _held(held_out: HeldOut | None) -> dict[str, Any]:
    """``plan.json``'s record of the hold-out: ``eval_shards`` (the held-out shards, or None) and, when records of
    the shards are held out instead, ``eval_records`` (how many)."""
    if held_out is None:
        return {"eval_shards": None}
    records = {"eval_records": held_out.rows.total} if held_out.rows is not None else {}
    return {"eval_shards": held_out.shards or None, **records}


def describe_data(
    path: Path, max_odd: int = 100, *, held_out: list[int] | None = None, validation: str | None = None
) -> dict[str, Any]:
    """What a run trains on, for ``compare`` and ``repro``: fingerprint, size, the majority provenance
    and the shards whose provenance differs from it (at most ``max_odd``; reads the index only); the
    shards held out for validation with their provenance, or the separate validation set's description."""
    from steadytrain.data import majority_provenance, open_dataset, provenance_outliers

    ds = open_dataset(path)
    odd = provenance_outliers(ds)
    extra: dict[str, Any] = {}
    if held_out:
        extra["holdout"] = {str(s): ds.shard(s).provenance for s in held_out}
    if validation is not None:
        extra["validation"] = describe_data(Path(validation), max_odd)
    return extra | {
        "path": str(Path(path).resolve()),
        "fingerprint": ds.fingerprint(),
        "shards": len(ds.shards),
        "records": ds.num_records,
        "provenance": majority_provenance(ds),
        "outliers": {str(k): {f: list(v) for f, v in d.items()} for k, d in sorted(odd.items())[:max_odd]},
        "outliers_total": len(odd),
    }


def describe_mixture(sources: SourceMap, validation: str | None = None) -> dict[str, Any]:
    """``data.json`` of a mixture run: each source described as one dataset is (with its name and first shard id),
    and the mixture's fingerprint (its sources' names and fingerprints)."""
    parts = [{"name": s.name, "offset": s.offset, **describe_data(Path(s.path))} for s in sources.spans]
    extra = {"validation": describe_data(Path(validation))} if validation is not None else {}
    return extra | {
        "path": None,
        "fingerprint": mixture_fingerprint([(p["name"], p["fingerprint"]) for p in parts]),
        "shards": sum(p["shards"] for p in parts),
        "records": sum(p["records"] for p in parts),
        "sources": parts,
    }


def check_environment(cfg: TrainConfig, info: DistInfo) -> Any:
    """Capture this rank's manifest and check the contract on every rank (all fail together)."""
    from steadytrain.env import Contract, capture, check

    manifest = capture()
    error = None
    if cfg.env.contract:
        violations = check(manifest, Contract.load(cfg.env.contract))
        if violations and cfg.env.on_violation == "fail":
            error = (
                f"rank {info.rank}: environment breaks {cfg.env.contract}: {violations[0]} (or env.on_violation=warn)"
            )
        for v in violations if not error else ():
            log.warning("rank %d: contract %s: %s", info.rank, cfg.env.contract, v)
    # each rank checks its own environment: one that breaks the contract stops all of them with its error
    agree(info, error)
    return manifest


def record_environment(info: DistInfo, run: RunDir, manifest: Any, *, resume: bool) -> list[str | None] | None:
    """Rank 0 writes its manifest; ranks whose image or host differ are reported by rank and field. Returns every
    rank's hostname on rank 0 (from the same gather; None on other ranks), for the records that name a rank's host."""
    from steadytrain.env import compare_ranks, gather_manifests

    # a collective (every rank sends its manifest): rank 0 compares every rank's image and host with its own
    manifests = gather_manifests(manifest)
    hosts = [m.host.get("hostname") for m in manifests] if manifests else None
    if not info.is_main or resume:
        return hosts
    run.write_json(run.env, manifest.to_dict())
    differing = compare_ranks(manifests) if manifests else {}
    if differing:
        report = {str(r): [d.__dict__ for d in diffs] for r, diffs in differing.items()}
        run.write_json(run.path / "env.ranks.json", report)
        for r, diffs in differing.items():
            fields = "; ".join(f"{d.path}: {d.a} vs {d.b}" for d in diffs[:5])
            log.warning("rank %d differs from rank 0: %s", r, fields)
    return hosts


def truncate_logs(run: RunDir, step: int, *, rollbacks: int | None) -> None:
    """Drop log lines past ``step`` (written after the checkpoint a resume or a rollback starts from) and a torn
    last line. A rollback's lines (its metrics row, its spike records) stay when the state at ``step`` had been
    through it (``rollbacks``: how many it had; None: all of them, the state of a rollback in progress)."""

    def keep(row: Any) -> bool:
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            return True
        if "rollback" in row and isinstance(row["rollback"], int):
            return rollbacks is None or row["rollback"] <= rollbacks
        return row["step"] <= step

    for path in (run.metrics, run.nonfinite, run.spikes, run.layers, run.path / "ranks.jsonl"):
        if path != run.spikes or rollbacks is not None:
            rewrite_jsonl(path, keep, what=path.name)


@dataclass(frozen=True)
class ResumeRecord:
    """What a resume records besides its step: the config and plan now in force, what the run holds out, and what
    the resume changed in the saved config (``{key: [saved, new]}``)."""

    cfg: TrainConfig
    plan: RunPlan
    held_out: HeldOut
    changes: dict[str, list[Any]]


def record_resume(run: RunDir, record: ResumeRecord, *, step: int, world_size: int, checkpoint: str) -> None:
    """Rank 0: ``resumes.jsonl`` gets this resume; ``config.yaml`` and ``plan.json`` the values now in force."""
    from steadytrain.train.job.resume import record_resume as append

    append(run, step=step, world_size=world_size, checkpoint=checkpoint, changes=record.changes)
    saved = load_json(run.plan, what="batch plan") if present(run.plan) else {}
    plan = {**record.plan.to_dict(), "data": saved.get("data"), **_held(record.held_out)}
    if record.changes:
        run.write_config(resolved_config(record.cfg))
        for key, (old, new) in record.changes.items():
            log.warning("resume: %s changed from %r to %r (applied from step %d)", key, old, new, step + 1)
    if saved != plan:
        run.write_json(run.plan, plan)


def decay_listing(optimizer: Any, no_decay: list[str]) -> str:
    """One line: the weight decay of each param group, with its tensor and element counts."""
    parts = []
    for g in optimizer.param_groups:
        n = sum(p.numel() for p in g["params"])
        parts.append(f"{g['weight_decay']:g} on {len(g['params'])} tensors ({n:,} parameters)")
    exempt = f"exempt: {', '.join(no_decay)}" if no_decay else "nothing exempt"
    return f"weight decay {'; '.join(parts)} ({exempt}; optim.no_decay)"


def log_start(job: Job) -> None:
    p = job.plan
    if not job.info.is_main:
        return
    rule = (
        f"{p.scaling_rule} x{p.global_batch_size / p.base_batch_size:g} from {p.base_lr:g} @ {p.base_batch_size}"
        if p.base_batch_size
        else "unscaled"
    )
    log.info(
        "effective batch %d = micro %d x accumulation %d x world %d; lr %.4g (%s); warmup %d of %d optimizer steps",
        p.global_batch_size,
        p.micro_batch_size,
        p.accumulation_steps,
        p.world_size,
        p.lr,
        rule,
        p.warmup_steps,
        p.total_steps,
    )
    log.info("%s", decay_listing(job.optimizer, job.cfg.optim.no_decay))
    if job.info.shape is not None:
        r, s, t = job.info.shape
        log.info(
            "mesh replicate=%d x shard=%d x tp=%d on %d ranks: the world above is the %d data-parallel ranks (the %d "
            "ranks of a tensor-parallel group read the same micro-batches)", r, s, t, job.info.world_size, r * s, t,
        )  # fmt: skip
    if p.dropped_per_epoch:
        log.info("%d example(s) per epoch do not fill a global batch and are not used", p.dropped_per_epoch)
    log.info("run directory: %s", job.run.path)


def _nonfinite_report(job: Job) -> str | None:
    """Rank 0: the diagnosis of a run that refused steps (:func:`~.records.write_nonfinite_report`); its sentence."""
    from steadytrain.train.job.records import write_nonfinite_report

    return write_nonfinite_report(job.run) if job.acc.skipped_steps else None


def finish(job: Job, stopped: str | None) -> dict[str, Any]:
    """Write ``summary.md``; log and return the run's numbers."""
    last = job.metrics.last if job.metrics else {}
    summary = {
        "run_dir": str(job.run.path),
        "steps": job.state.step,
        "skipped_steps": job.acc.skipped_steps,
        "final_loss": last.get("loss"),
        "elapsed_s": round(job.metrics.elapsed(), 1) if job.metrics else 0.0,
        "stopped": stopped,
    }
    if job.compile_s is not None:
        summary["compile_s"] = job.compile_s  # part of elapsed_s (and of the first step's time)
    if job.info.is_main:
        p = job.plan
        lines = [
            f"# Run {md(job.run.path.name)}",
            "",
            f"- effective batch {p.global_batch_size} = micro {p.micro_batch_size} x accumulation "
            f"{p.accumulation_steps} x world {p.world_size}; peak LR {p.lr:.4g} ({p.scaling_rule} rule)",
            f"- optimizer steps {job.state.step} of {p.total_steps}, skipped {job.acc.skipped_steps}",
            f"- final loss {summary['final_loss']}, wall time {summary['elapsed_s']} s",
        ]
        if job.run.metrics.exists():  # the whole run's rows (a resumed run's earlier ones too)
            summary |= summarize(read_metrics(job.run.metrics)[0])
        if text := describe(summary):
            lines.append(f"- throughput: {text}")
        if stopped:
            lines.append(f"- stopped early: {md(stopped)}")
        if (v := job.validation) is not None and v.best_step is not None:
            lines.append(f"- best validation loss {v.best_loss:.6g} at step {v.best_step}")
        if sentence := _nonfinite_report(job):
            lines.append(f"- non-finite steps: {md(sentence)} (nonfinite\\_report.json)")
        write_text_atomic(job.run.summary, "\n".join(lines) + "\n")  # the command adds plots (runs.report)
        log.info(
            "%s: %d steps (%d skipped), final loss %s, %.1f s; run directory %s",
            "stopped" if stopped else "done",
            job.state.step,
            job.acc.skipped_steps,
            summary["final_loss"],
            summary["elapsed_s"],
            job.run.path,
        )
    # every rank reports the run done (returns, or raises why it stopped) only once rank 0's summary.md is on disk
    barrier(job.info)
    return summary
