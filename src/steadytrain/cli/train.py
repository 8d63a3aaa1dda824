"""``steadytrain train`` and ``steadytrain config show``: parse, build, run, print."""

from __future__ import annotations

import logging
import os
import sys

import click

from steadytrain._text import one_line
from steadytrain._yamlio import dump_yaml
from steadytrain.cli._common import WholeNumber, console, log_handler


def _setup_logging() -> None:
    """Rank 0 logs progress at INFO; other ranks only warnings, tagged with their rank."""
    rank = os.environ.get("RANK", "0")
    root = logging.getLogger("steadytrain")
    root.handlers[:] = [log_handler("" if rank == "0" else f"[rank {rank}] ")]
    root.setLevel(logging.INFO if rank == "0" else logging.WARNING)
    root.propagate = False


def _handoff(nproc: int, argv: list[str], max_restarts: int | None = None) -> None:
    """``--nproc N``: run this command under torchrun on this node, in this process (never returns).

    A Ctrl-C reaches torchrun, which passes it to every rank: the ranks stop with a checkpoint and
    say how to resume; torchrun's own report of the signal is not printed as a traceback. A SIGTERM (or
    SIGUSR1, where torchrun passes it on) is a preemption: the same way, and exit 75 (requeue me). The ranks
    get this process's pid, and die with it (see :mod:`steadytrain.train.setup.launcher`). ``max_restarts``:
    torchrun restarts the ranks that many times after a failure, and each restart resumes (``--auto-resume``).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from steadytrain.train.job.stop import signal_exit_code
    from steadytrain.train.setup.launcher import LAUNCHER_PID

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            rest.append(a)
    restarts = []
    if max_restarts is not None:
        restarts = [f"--max-restarts={max_restarts}"]
        rest += [] if "--auto-resume" in rest else ["--auto-resume"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # each restart's ranks meet in a store of their own: in torchrun's shared store the previous attempt's
    # process-group keys are still there, and a restarted rank can read a dead peer's address from them
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # SIGUSR1 too: torchrun passes it to the ranks, a preemption as SIGTERM is (its --signals-to-handle, of recent
    # torch versions; an older torchrun dies of it)
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks' environment (torchrun's agent is this process)
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", *restarts, "-m", "steadytrain", *rest])
    except SignalException as err:  # the ranks had torchrun's shutdown timeout to stop: a preemption exits 75
        raise click.exceptions.Exit(signal_exit_code(int(err.sigval))) from None
    except ChildFailedError as err:  # the ranks printed why; torchrun's summary is above
        _, failure = err.get_first_failure()
        if max_restarts:
            click.echo(
                f"the ranks failed again after {max_restarts} restart(s) (--max-restarts {max_restarts}): see the "
                "first failure above; the run directory keeps its latest complete checkpoint for --auto-resume",
                err=True,
            )
        raise click.exceptions.Exit(failure.exitcode if 0 < failure.exitcode < 256 else 1) from None
    finally:
        os.environ.pop(LAUNCHER_PID, None)
    raise click.exceptions.Exit(0)


@click.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key, e.g. batch.micro_batch_size=8.",
)
@click.option(
    "--run-dir", type=click.Path(file_okay=False), default=None, help="The run directory (default runs/<run.name>)."
)
@click.option(
    "--resume",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Continue this run from its latest checkpoint.",
)
@click.option(
    "--auto-resume",
    is_flag=True,
    help="Resume the run directory from its latest checkpoint if it has one, else start it (restarts, requeues).",
)
@click.option("--nproc", type=WholeNumber(1, 1024), default=None, help="Ranks on this machine (hands off to torchrun).")
@click.option(
    "--max-restarts",
    type=WholeNumber(0, 1000),
    default=None,
    help="With --nproc: torchrun restarts failed ranks this many times; each restart resumes (--auto-resume).",
)
def train(
    config: str | None,
    overrides: tuple[str, ...],
    run_dir: str | None,
    resume: str | None,
    auto_resume: bool,
    nproc: int | None,
    max_restarts: int | None,
) -> None:
    """Train: the embedded default with no CONFIG, or CONFIG.yaml; under torchrun on every rank."""
    from pathlib import Path

    from steadytrain.train.setup.launcher import die_with_launcher

    die_with_launcher()  # a rank under torchrun: before anything else, so a launcher killed now takes it along
    from steadytrain.train.setup.config import load_config

    if resume is not None and config is not None:
        raise click.UsageError("give CONFIG or --resume RUN_DIR, not both (a resumed run uses its own config.yaml)")
    if resume is not None and auto_resume:
        raise click.UsageError("give --resume RUN_DIR or --auto-resume --run-dir RUN_DIR, not both")
    if max_restarts is not None and nproc is None and "RANK" not in os.environ:
        raise click.UsageError("--max-restarts needs --nproc N (torchrun restarts the ranks it starts)")
    from steadytrain.rundir.layout import open_run_dir

    source = open_run_dir(Path(resume)).config if resume is not None else config
    cfg = load_config(source, list(overrides))  # a config mistake is said before torch and the loop are imported
    auto = auto_resume or max_restarts is not None
    if nproc is not None and "RANK" not in os.environ:
        from steadytrain.train.setup.pieces import check_before_launch

        check_before_launch(
            cfg, run_dir=Path(run_dir) if run_dir else None, resume=resume is not None or auto, world_size=nproc
        )
        _handoff(nproc, sys.argv[1:], max_restarts)  # every mistake found here is said once, not once per rank
    from steadytrain.runs.report import report_after_training
    from steadytrain.train.job.loop import TrainingStopped
    from steadytrain.train.job.loop import train as run_training
    from steadytrain.train.job.resume import RunFinished

    _setup_logging()
    main = os.environ.get("RANK", "0") == "0"
    try:  # rank 0 writes the report (plots, summary.md) when the run ends, before its trackers close
        run_training(
            cfg,
            run_dir=Path(run_dir) if run_dir else None,
            resume=Path(resume) if resume else None,
            report=report_after_training,
            auto_resume=auto,
        )
    except TrainingStopped as err:
        if main:  # every rank stops for the same reason: say it once
            click.echo(f"stopped: {err}", err=True)
        raise click.exceptions.Exit(err.exit_code) from None
    except RunFinished as err:
        if not auto:  # --resume of a finished run: the user's mistake (exit 2)
            raise
        if main:  # a requeue or a retry after the last step: done already, and that is success
            click.echo(one_line(err.done), err=True)
        raise click.exceptions.Exit(0) from None


@click.group("config")
def config_group() -> None:
    """Training configs."""


@config_group.command("show")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key.")
@click.option(
    "--world-size",
    type=WholeNumber(1, 1_000_000),
    default=None,
    help="Ranks to plan for (default: the ranks of distributed.mesh, else 1).",
)
def show(config: str | None, overrides: tuple[str, ...], world_size: int | None) -> None:
    """Print the resolved config and its batch plan (effective batch, scaled LR, warmup and total steps)."""
    from steadytrain.train.setup.config import load_config

    cfg = load_config(config, list(overrides))  # a config mistake is said before torch is imported
    import torch

    from steadytrain.train.setup.distributed import DistInfo
    from steadytrain.train.setup.mesh import mesh_shape
    from steadytrain.train.setup.mixture import training_data
    from steadytrain.train.setup.pieces import check_model_args, resolve_plan

    check_model_args(cfg, user_code=False)  # inspecting a config never runs a factory it names
    mesh = cfg.distributed.mesh
    world_size = world_size or (mesh.ranks if mesh is not None else 1)
    world_size //= mesh_shape(cfg.distributed, world_size)[2]  # the data-parallel degree: tp ranks share batches
    layout = resolve_plan(cfg, world_size, None)
    info = DistInfo(0, world_size, 0, torch.device("cpu"), None)
    # the plan counts what the run trains on (without what it holds out)
    ds, _, _ = training_data(cfg, info, layout.global_batch_size, layout.accumulation_steps)
    plan = resolve_plan(cfg, world_size, ds.steps_per_epoch, ds.dropped_per_epoch)
    click.echo(dump_yaml(cfg.to_dict(), allow_unicode=False), nl=False)
    console.print("# derived (batch plan)")
    click.echo(dump_yaml({"plan": plan.to_dict()}, allow_unicode=False), nl=False)
