"""``steadytrain plan``: the batch plan of a run."""

from __future__ import annotations

import json

import click
from rich.table import Table
from rich.text import Text

from steadytrain.cli._common import Number, WholeNumber, console
from steadytrain.schedule import MAX_SWEEP, SCALING_RULES, BatchPlan


@click.command()
@click.option(
    "--micro-batch-size", type=WholeNumber(), required=True, help="Examples per forward/backward on one device."
)
@click.option("--accumulation-steps", type=WholeNumber(), default=None, help="Micro-batches per optimizer step.")
@click.option("--world-size", type=WholeNumber(), default=1, show_default=True, help="Data-parallel ranks.")
@click.option(
    "--global-batch-size", type=WholeNumber(), default=None, help="Target effective batch (derives accumulation)."
)
@click.option("--base-lr", type=Number(), default=None, help="LR known to work at --base-batch-size.")
@click.option("--base-batch-size", type=WholeNumber(), default=None, help="Batch size --base-lr was tuned at.")
@click.option("--scaling-rule", type=click.Choice(SCALING_RULES), default="linear", show_default=True)
@click.option("--dataset-size", type=WholeNumber(), default=None, help="Examples per epoch, all ranks together.")
@click.option("--epochs", type=WholeNumber(), default=1, show_default=True)
@click.option("--warmup-steps", type=WholeNumber(), default=None, help="Warmup in optimizer steps.")
@click.option("--warmup-ratio", type=Number(), default=None, help="Warmup as a fraction of all optimizer steps.")
@click.option(
    "--sweep",
    type=WholeNumber(0, MAX_SWEEP),
    default=5,
    show_default=True,
    help="LRs in the suggested sweep (0: none).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(sweep: int, as_json: bool, **kwargs) -> None:
    """Effective batch, scaled learning rate, and step counts (in optimizer steps) of a run."""
    batch_plan = BatchPlan(**kwargs)  # a UserError names the field, the value and the fix
    lrs = batch_plan.lr_sweep(sweep) if sweep and batch_plan.lr is not None else []
    if as_json:
        click.echo(json.dumps({**batch_plan.to_dict(), "lr_sweep": lrs}, indent=2, allow_nan=False))
        return
    console.print(_plan_table(batch_plan, lrs))
    for note in batch_plan.notes:
        console.print(Text.assemble(("note:", "yellow"), f" {note}"))


def _plan_table(p: BatchPlan, lrs: list[float]) -> Table:
    table = Table(title="steadytrain batch plan", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("how", style="dim")
    table.add_row(
        "effective batch",
        str(p.global_batch_size),
        f"micro {p.micro_batch_size} x accum {p.accumulation_steps} x world {p.world_size}",
    )
    if p.lr is not None:
        base = f"{p.base_lr:g} @ {p.base_batch_size}" if p.base_batch_size else f"{p.base_lr:g} (unscaled)"
        table.add_row("learning rate (peak)", f"{p.lr:.6g}", f"{base}, {p.scaling_rule} x{p.scale_factor:g}")
    if lrs:
        table.add_row("LR sweep", ", ".join(f"{x:.3g}" for x in lrs), "geometric, centred on the estimate")
    if p.total_steps is not None:
        table.add_row("micro-batches / epoch / rank", str(p.micro_batches_per_epoch), f"{p.dataset_size} examples")
        table.add_row("optimizer steps / epoch", str(p.steps_per_epoch), "a partial last cycle is a step")
        table.add_row("optimizer steps (total)", str(p.total_steps), f"{p.epochs} epoch(s)")
    if p.warmup_steps is not None:
        table.add_row("warmup (optimizer steps)", str(p.warmup_steps), "step the scheduler once per optimizer step")
    return table
