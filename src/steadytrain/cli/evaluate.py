"""``steadytrain eval RUN`` and ``steadytrain export RUN``: parse, call the library (:mod:`steadytrain.runs.evaluate`,
:mod:`steadytrain.runs.export`), print (rank 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from steadytrain.cli._common import WholeNumber, run_argument


@click.command("eval")
@run_argument
@click.option("--step", type=WholeNumber(1), default=None, help="The checkpoint's step (default: the latest).")
@click.option(
    "--data", type=click.Path(file_okay=False), default=None, help="Evaluate on this dataset instead of RUN's own."
)
@click.option("--json", "as_json", is_flag=True, help='Print {"step", "val_loss", "val_items"}.')
def eval_cmd(run: str, step: int | None, data: str | None, as_json: bool) -> None:
    """The validation loss of RUN's checkpoint: the mean per-example loss over its validation examples."""
    from steadytrain._text import one_line
    from steadytrain.runs.evaluate import evaluate_run

    row = evaluate_run(Path(run), step=step, data=data)
    if os.environ.get("RANK", "0") != "0":
        return
    if as_json:
        click.echo(json.dumps({k: row[k] for k in ("step", "val_loss", "val_items")}))
    else:
        loss = "not finite" if row["val_loss"] is None else f"{row['val_loss']:.6g}"
        where = one_line(data) if data else "the run's validation set"
        click.echo(f"step {row['step']}: val_loss {loss} over {row['val_items']} examples ({where})")
    if row["val_loss"] is None:
        raise click.exceptions.Exit(1)


@click.command("export")
@run_argument
@click.option("--step", type=WholeNumber(1), default=None, help="The checkpoint's step (default: the latest).")
@click.option(
    "--format", "fmt", type=click.Choice(["safetensors", "hf"]), default="safetensors", show_default=True,
    help="safetensors: one file of the model's tensors; hf: a transformers directory (runs of hf: models).",
)  # fmt: skip
@click.option("--out", required=True, type=click.Path(), help="FILE.safetensors, or a directory with --format hf.")
def export_cmd(run: str, step: int | None, fmt: str, out: str) -> None:
    """RUN's model as one safetensors file (load it with load_state_dict(strict=True) into the model), or with
    --format hf a directory that AutoModelForCausalLM.from_pretrained loads."""
    from steadytrain._text import one_line
    from steadytrain.runs.export import export_hf, export_model

    done = (export_hf if fmt == "hf" else export_model)(Path(run), Path(out), step=step)
    click.echo(f"step {done['step']}: {done['tensors']} tensors ({done['bytes']} bytes) -> {one_line(done['out'])}")
