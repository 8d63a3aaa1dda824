"""``steadytrain env``: capture, diff, check, lock, dockerfile, tag.

Every bad input is a :class:`~steadytrain.errors.UserError` raised by the library (a file, a field, a
flag) and printed by ``steadytrain.cli.main`` as one line, exit 2; exit 1 means "checked, found problems".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from steadytrain._io import brief, write_text_atomic
from steadytrain.cli._common import UserError, console


def _emit(text: str, output: str | None, what: str) -> None:
    if output is None:
        sys.stdout.write(text)
    else:
        write_text_atomic(output, text)  # a missing directory is a UserError; nothing half-written
        click.echo(f"wrote {what} to {output}", err=True)


def _manifest(path: str | None):
    from steadytrain.env import EnvManifest, capture

    return capture() if path is None else EnvManifest.load(path)


@click.group()
def env() -> None:
    """Reproducible environments: what the image pins and what the host adds."""


@env.command("capture")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the manifest here (else stdout).")
def capture_cmd(output: str | None) -> None:
    """Record image, host, code and settings as JSON."""
    from steadytrain.env import capture

    _emit(json.dumps(capture().to_dict(), indent=2) + "\n", output, "the environment manifest")


@env.command("diff")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
def diff_cmd(a: str, b: str) -> None:
    """Differences between two manifests, grouped by scope; exit 1 if any."""
    from steadytrain._io import one_line
    from steadytrain.env import SCOPES, diff, summarize

    diffs = diff(_manifest(a), _manifest(b))
    for scope in SCOPES:
        mine = [d for d in diffs if d.scope == scope]
        if not mine:
            continue
        table = Table(title=f"{scope} ({len(mine)})", title_justify="left")
        table.add_column("field")
        table.add_column(one_line(Path(a).name))
        table.add_column(one_line(Path(b).name))
        for d in mine:
            table.add_row(one_line(d.path.split(".", 1)[1]), one_line(d.a), one_line(d.b))
        console.print(table)
    click.echo(summarize(diffs))  # one line, never wrapped: scripts read it
    if diffs:
        raise click.exceptions.Exit(1)


@env.command("check")
@click.option("--contract", "contract_path", required=True, type=click.Path(dir_okay=False))
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False), help="A saved manifest (else capture).")
def check_cmd(contract_path: str, manifest_path: str | None) -> None:
    """Check the environment against a contract (validated driver, kernel, CUDA, packages); exit 1 on violation."""
    from steadytrain._io import one_line
    from steadytrain.env import Contract, check

    violations = check(_manifest(manifest_path), Contract.load(contract_path))
    for v in violations:
        click.echo(f"violation: {one_line(v.message)}")
    if violations:
        click.echo(f"{len(violations)} violation(s) of {one_line(contract_path)}")
        raise click.exceptions.Exit(1)
    click.echo(f"ok: the environment satisfies {one_line(contract_path)}")


@env.command("lock")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the lockfile here (else stdout).")
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False), help="A saved manifest (else capture).")
@click.option("--for", "roots", multiple=True, help="Only these distributions and what they require (repeatable).")
def lock_cmd(output: str | None, manifest_path: str | None, roots: tuple[str, ...]) -> None:
    """``name==version`` for every installed distribution (or the closure of --for)."""
    from steadytrain.env import lockfile
    from steadytrain.env.lockfile import requirement_closure

    if roots and manifest_path is not None:
        raise UserError(
            "--for and --manifest cannot be combined: --for follows the requirements of the distributions "
            "installed here, which a saved manifest does not record; drop --manifest (lock this environment) "
            "or drop --for (lock every package of the manifest)"
        )
    manifest = _manifest(manifest_path)
    only = exclude = None
    if roots:
        from steadytrain.env import grammar

        for root in roots:
            grammar.dist_name("--for", root)
        try:
            only = requirement_closure(roots)
        except KeyError as err:
            raise UserError(f"--for {brief(err.args[0])}: not installed in this environment") from None
        exclude = set(roots)  # the project itself is installed from source, not pinned
    _emit(lockfile(manifest, only=only, exclude=exclude), output, "the lockfile")


@env.command("dockerfile")
@click.option("--base", "base_image", required=True, help="Base image with a tag, e.g. python:3.11.7-slim-bookworm.")
@click.option("--digest", "base_digest", default=None, help="sha256:... digest of the base image.")
@click.option("--tag", default=None, help="The image tag to label (see `env tag`).")
@click.option("--lockfile", "lockfile_path", default="requirements.lock", show_default=True)
@click.option("--contract", "contract_path", default="contract.yaml", show_default=True)
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False), help="A saved manifest (else capture).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the Dockerfile here (else stdout).")
def dockerfile_cmd(base_image, base_digest, tag, lockfile_path, contract_path, manifest_path, output) -> None:
    """A Dockerfile: pinned base, lockfile installed --no-deps, commit label, contract checked at start."""
    from steadytrain.env import dockerfile

    text = dockerfile(
        _manifest(manifest_path),
        base_image=base_image,
        base_digest=base_digest,
        lockfile_path=lockfile_path,
        contract_path=contract_path,
        tag=tag,
    )
    _emit(text, output, "the Dockerfile")


@env.command("tag")
@click.option("--name", required=True, help="Image repository name, e.g. training.")
@click.option("--version", "version", required=True, help="Your release, e.g. 2.3.1.")
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False), help="A saved manifest (else capture).")
def tag_cmd(name: str, version: str, manifest_path: str | None) -> None:
    """The image tag: name:vVERSION-cudaX.Y-cudnnA.B-torchT (or -cpu-torchT)."""
    from steadytrain.env import image_tag

    click.echo(image_tag(_manifest(manifest_path), name, version))
