"""One rule for numbers in the training config (issue 47, "One rule for numbers"): wherever a key takes a number,
text, a flag or a float for an integer is refused, in every section; every integer has an upper bound; YAML's
number forms are read by one rule; ``distributed.watchdog_s`` is bounded to what can work."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

from steadytrain._yamlio import load_yaml, parse_yaml
from steadytrain.errors import UserError
from steadytrain.schedule import MAX_COUNT
from steadytrain.train.setup.config import TrainConfig, load_config, resolved_config
from tests.cli_utils import assert_user_error


def _kinds(annotation: Any) -> set[Any]:
    """Every type named in ``annotation`` (through Optional, Annotated, lists, tuples and mappings)."""
    origin = get_origin(annotation)
    if origin is None:
        return {annotation}
    if origin is Literal:  # its arguments are values, not types
        return set()
    if origin is Annotated:
        return _kinds(get_args(annotation)[0])
    return set().union(*(_kinds(a) for a in get_args(annotation) if a is not Ellipsis))


def _shaped(annotation: Any, leaf: Any) -> Any:
    """A value of ``annotation``'s shape whose numbers are all ``leaf`` (``{"a": leaf}`` for a mapping...)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _shaped(args[0], leaf)
    if origin in (Union, types.UnionType):
        return _shaped(next(a for a in args if {int, float} & _kinds(a)), leaf)
    if origin is dict:
        return {"a": _shaped(args[1], leaf)}
    if origin in (list, tuple):
        return [_shaped(a, leaf) for a in (args if origin is tuple and Ellipsis not in args else args[:1])]
    return leaf


def _number_fields(model: type[BaseModel] = TrainConfig, seen: set[type] | None = None):
    """``(model, key, annotation)`` for every field of every section that takes a number, found from the models."""
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        kinds = _kinds(field.annotation)
        for sub in kinds:
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from _number_fields(sub, seen)
        if {int, float} & kinds:
            yield model, field.alias or name, field.annotation


NUMBER_FIELDS = list(_number_fields())
_IDS = [f"{m.__name__}.{k}" for m, k, _ in NUMBER_FIELDS]


def _refusal(model: type[BaseModel], key: str, value: Any) -> str | None:
    """The message of the error at ``key`` when ``model`` validates ``{key: value}`` alone (None: none there;
    errors for other keys, such as required ones left out, do not count)."""
    try:
        model.model_validate({key: value})
    except ValidationError as err:
        found = [e for e in err.errors() if e["loc"][:1] == (key,)]
        return found[0]["msg"] if found else None
    return None


_ISSUE_KEYS = (
    "DistributedConfig.watchdog_s",
    "DistributedConfig.parity_every_steps",
    "MeshConfig.shard",
    "SourceConfig.weight",
    "MixStepConfig.step",
    "MixStepConfig.weights",
    "OptimConfig.betas",
    "ModelConfig.ac_every",
    "MonitorConfig.every_steps",
)
assert set(_ISSUE_KEYS) <= set(_IDS) and len(_IDS) > 40, _IDS  # the walk finds what the issue names, and more


@pytest.mark.parametrize(("model", "key", "annotation"), NUMBER_FIELDS, ids=_IDS)
def test_text_or_a_flag_is_not_a_number_in_any_section(model, key, annotation):
    for text in ("3", "1_0", "0x10", "٣"):
        msg = _refusal(model, key, _shaped(annotation, text))
        assert msg is not None and "text, not" in msg and "digits 0-9" in msg, (text, msg)
    msg = _refusal(model, key, _shaped(annotation, True))  # optim.betas took [true, 0.95] as (1.0, 0.95)
    assert msg is not None and "a flag" in msg and "give a number" in msg, msg


INT_FIELDS = [(m, k, a) for m, k, a in NUMBER_FIELDS if int in _kinds(a)]
_INT_IDS = [f"{m.__name__}.{k}" for m, k, _ in INT_FIELDS]


@pytest.mark.parametrize(
    ("model", "key", "annotation"), INT_FIELDS, ids=[f"{m.__name__}.{k}" for m, k, _ in INT_FIELDS]
)
def test_every_integer_key_takes_no_float_and_has_an_upper_bound(model, key, annotation):
    msg = _refusal(model, key, _shaped(annotation, 3.0))
    assert msg is not None and "write it as 3" in msg, msg
    assert _refusal(model, key, _shaped(annotation, 10**30)) is not None  # 10**23 steps of parity took before


def _config(tmp_path, text: str) -> Any:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("distributed:\n  watchdog_s: '10'\n", "distributed.watchdog_s='10'"),
        ("distributed:\n  mesh: {shard: '2'}\n", "distributed.mesh.shard='2'"),
        ('data:\n  sources: [{name: a, path: /x/a, weight: "3"}]\n', "data.sources.0.weight='3'"),
        (
            "data:\n  sources: [{name: a, path: /x/a, weight: 1}, {name: b, path: /x/b, weight: 1}]\n"
            '  mix_schedule: [{step: "3", weights: {a: 1, b: 2}}]\n',
            "data.mix_schedule.0.step='3'",
        ),
        ("monitor:\n  every_steps: 2_0\n", "monitor.every_steps='2_0'"),  # YAML 1.1 reads 20
        ("distributed:\n  parity_every_steps: 2_0\n", "distributed.parity_every_steps='2_0'"),
        ("run:\n  max_steps: 0x10\n", "run.max_steps='0x10'"),  # YAML 1.1 reads 16
        ("run:\n  log_every: 1:30\n", "run.log_every='1:30'"),  # YAML 1.1 reads 90
    ],
)
def test_a_quoted_or_odd_number_in_a_config_file_is_refused_naming_the_key(tmp_path, text, key):
    with pytest.raises(UserError, match="text, not") as err:
        _config(tmp_path, text)
    assert key in str(err.value) and "digits 0-9" in str(err.value), err.value


def test_the_config_reads_numbers_as_yaml_1_2_does(tmp_path):
    # 3e-4 and 1e3 are text to yaml.safe_load (YAML 1.1 wants a dot): refusing text must not refuse them
    cfg = _config(tmp_path, "batch:\n  base_lr: 3e-4\nrun:\n  peak_flops: 1e12\n  seed: 017\n")
    assert cfg.batch.base_lr == 3e-4 and cfg.run.peak_flops == 1e12 and cfg.run.seed == 17  # not octal 15
    assert parse_yaml("[2_0, 0x10, 0b11, '1:30', 1:30, 1e3, .5, -7]", source="x") == [
        "2_0",
        "0x10",
        "0b11",
        "1:30",
        "1:30",
        1000.0,
        0.5,
        -7,
    ]


def test_a_float_for_an_integer_is_refused_with_the_integer_to_write(tmp_path):
    with pytest.raises(UserError, match=r"run\.max_steps=1000\.0: .*write it as 1000"):
        _config(tmp_path, "run:\n  max_steps: 1e3\n")


def test_a_saved_config_whose_text_reads_as_a_number_loads_back(tmp_path, cli):
    # run.name '1e3' is text (quoted), and a number to this project's YAML if written unquoted
    cfg = load_config(overrides=["run.name='1e3'", "data.sources=[{name: '2e5', path: /x/a, weight: 1}]"])
    from steadytrain.rundir.layout import RunDir

    RunDir(tmp_path).write_config(resolved_config(cfg))
    saved = load_yaml(tmp_path / "config.yaml")
    assert saved["run"]["name"] == "1e3" and saved["data"]["sources"][0]["name"] == "2e5"
    r = cli("config", "show", "--set", "run.name='1e3'")
    assert "name: '1e3'" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("0.0001", "under 1 s a healthy job is called hung"),
        ("0.5", "under 1 s"),
        ("-1", "under 1 s"),
        ("1e30", "over a day (86400 s)"),
        ("86401", "over a day"),
    ],
)
def test_the_watchdog_wait_is_bounded_to_what_can_work(value, why):
    with pytest.raises(UserError) as err:
        load_config(overrides=[f"distributed.watchdog_s={value}"])
    line = str(err.value)
    for word in ("distributed.watchdog_s", "is out of bounds", "give 0 (off) or 1 to 86400 seconds", why):
        assert word in line, (word, line)


def test_the_watchdog_wait_takes_off_or_a_second_to_a_day():
    for value in ("0", "1", "3", "600", "86400"):
        assert load_config(overrides=[f"distributed.watchdog_s={value}"]).distributed.watchdog_s == float(value)
    for value in ("0.999", "86400.5"):
        with pytest.raises(UserError, match="out of bounds"):
            load_config(overrides=[f"distributed.watchdog_s={value}"])


def test_the_parity_interval_has_the_bound_of_every_step_count(cli):
    assert load_config(overrides=[f"distributed.parity_every_steps={MAX_COUNT}"]).distributed.parity_every_steps
    r = cli("config", "show", "--set", "distributed.parity_every_steps=100000000000000000000000")
    assert_user_error(
        r, "distributed.parity_every_steps=100000000000000000000000", f"less than or equal to {MAX_COUNT}"
    )


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("optim.betas=[true, 0.95]", ["optim.betas: item 0: true is a flag"]),  # taken as 1.0 before
        ("batch.warmup_ratio=.nan", ["batch.warmup_ratio=nan", "finite"]),
        ("optim.momentum=.nan", ["optim.momentum=nan", "finite"]),
        ("eval.holdout_fraction=.nan", ["eval.holdout_fraction=nan", "finite"]),
        ("run.peak_flops=" + "9" * 400, ["run.peak_flops=", "too large a number"]),
        # mfu = FLOP/s / 1e-300 is inf: the run stopped with a traceback writing its first metrics row
        ("run.peak_flops=1e-300", ["run.peak_flops=1e-300", "greater than or equal to 1000000"]),
        ("model.ac_every='2'", ["model.ac_every='2'", "text, not an integer"]),
        ("checkpoint.keep_last=100000000000000000000", ["checkpoint.keep_last=", "less than or equal to"]),
    ],
)
def test_hostile_numbers_are_one_line_naming_the_key(cli, item, words):
    assert_user_error(cli("config", "show", "--set", item), *words)
