"""The documentation cannot drift: the checked-in reference equals what the code generates, the generator
covers every config key and every command (checked by walks of their own), and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from steadytrain.cli import cli, docgen
from steadytrain.train.setup.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def _schema_keys(schema: dict, node: dict, prefix: str = "") -> set[str]:
    """Dotted keys from the JSON schema: a walk of the models independent of the generator's."""
    keys: set[str] = set()
    for name, prop in node.get("properties", {}).items():
        refs = [p["$ref"] for p in [prop, *prop.get("anyOf", []), *prop.get("allOf", [])] if "$ref" in p]
        sub = schema["$defs"][refs[0].rsplit("/", 1)[1]] if refs else None
        # A section that is always there is only a heading; an optional one (run.profile) is a key too.
        if sub is None or ("default" in prop and prop["default"] is None):
            keys.add(prefix + name)
        if sub is not None:
            keys |= _schema_keys(schema, sub, prefix + name + ".")
    return keys


def _commands(group: click.Group, ctx: click.Context, path: str) -> dict[str, click.Command]:
    """Every visible command by its full path, through ``list_commands``/``get_command``."""
    found = {path: group}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        if isinstance(cmd, click.Group):
            found |= _commands(cmd, click.Context(cmd, info_name=name, parent=ctx), f"{path} {name}")
        else:
            found[f"{path} {name}"] = cmd
    return found


def _section(page: str, heading: str) -> str:
    """The text of one command's section of cli.md (up to the next heading)."""
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", page, flags=re.S | re.M)
    assert match, f"cli.md has no section '{heading}'"
    return match.group(1)


@pytest.mark.parametrize("name", ["config.md", "cli.md"])
def test_checked_in_reference_is_current(tmp_path, name):
    docgen.write_pages(tmp_path)
    fresh = (tmp_path / name).read_text(encoding="utf-8")
    checked_in = REFERENCE / name
    assert checked_in.is_file(), f"docs/reference/{name} is missing: run `make docs` and commit it"
    assert checked_in.read_text(encoding="utf-8") == fresh, (
        f"docs/reference/{name} is stale (the config or the commands changed): run `make docs` and commit it"
    )


def test_every_config_key_is_documented():
    schema = TrainConfig.model_json_schema(by_alias=True)
    expected = _schema_keys(schema, schema)
    generated = [k.key for k in docgen.config_keys()]
    assert len(generated) == len(set(generated))
    assert set(generated) == expected
    page = docgen.render_config()
    missing = sorted(k for k in expected if f"| `{k}` |" not in page)
    assert not missing, f"config.md lacks {missing}"


def test_config_keys_are_written_as_a_user_writes_them():
    keys = {k.key: k for k in docgen.config_keys()}
    assert "data.schema" in keys and "checkpoint.async" in keys
    assert not {"data.schema_file", "checkpoint.async_"} & keys.keys()
    assert keys["batch.micro_batch_size"].default == "`16`"
    assert keys["run.profile.start_step"].default == "required"
    assert "2" in keys["eval.holdout_shards"].default  # the embedded default run's value, beside the field's
    assert "Open section" in docgen.render_config().split("## `data`")[0]  # model: the factory's keyword args


def test_every_command_and_option_is_documented():
    page = docgen.render_cli()
    commands = _commands(cli, click.Context(cli, info_name="steadytrain"), "steadytrain")
    assert {"steadytrain train", "steadytrain data ingest", "steadytrain env capture", "steadytrain nan hunt"} <= set(
        commands
    )
    for path, cmd in commands.items():
        text = _section(page, path)
        for param in cmd.params:
            if getattr(param, "hidden", False):
                continue
            names = [param.name.upper()] if isinstance(param, click.Argument) else param.opts
            for name in names:
                assert f"`{name}`" in text, f"cli.md: '{path}' lacks {name}"


def test_reference_holds_no_machine_values():
    for text in docgen.render_pages().values():
        assert str(ROOT) not in text and str(Path.home()) not in text
        assert str(Path.cwd()) not in text


def test_normalize_shortens_paths():
    assert docgen._normalize(f"{Path.home()}/.cache/x") == "~/.cache/x"
    assert docgen._value(None) == "null" and docgen._value((0.9, 0.95)) == "[0.9, 0.95]"


PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))]
)
def test_relative_links_resolve(page):
    source = ROOT / page
    text = re.sub(r"```.*?```", "", source.read_text(encoding="utf-8"), flags=re.S)  # no links in code blocks
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, mailto:)
        path, _, anchor = target.partition("#")
        linked = source.parent / path if path else source
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page}: links to missing files or headings {broken}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {docgen._anchor(h.replace("`", "")) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
