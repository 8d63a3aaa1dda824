"""A config mistake is refused before torch is imported: the config, its validation and the commands that read it
first stand alone (each checked in a fresh interpreter, where ``sys.modules`` shows what was imported)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from steadytrain.train.setup.config import TINY_LM_KEYS, load_config
from steadytrain.train.setup.models import TinyLM

HEAVY = ("torch", "pyarrow", "transformers", "matplotlib")

VALIDATE = """
import sys
from steadytrain.errors import UserError
from steadytrain.train.setup.config import load_config
try:
    load_config(None, [{item!r}])
except UserError as err:
    print(err)
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""

COMMAND = """
import sys
from steadytrain.cli import main
print("rc", main({argv!r}))
print(sorted(m for m in {heavy!r} if m in sys.modules))
"""


def _fresh(code: str) -> tuple[list[str], str]:
    """``code`` run by a new interpreter: its output lines and its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines(), proc.stderr


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("nosuch.key=1", "unknown key 'nosuch'"),
        ("model.dimm=3", "tiny-lm has no key 'dimm'"),
        ("batch.micro_batch_size=0", "batch.micro_batch_size=0"),
    ],
)
def test_validating_a_config_imports_no_heavy_library(item, words):
    (refused, imported), _ = _fresh(VALIDATE.format(item=item, heavy=HEAVY))
    assert words in refused
    assert imported == "[]"


@pytest.mark.parametrize("argv", [["train"], ["config", "show"]])
@pytest.mark.parametrize("item", ["nosuch.key=1", "model.dimm=3"])
def test_a_command_refuses_a_config_typo_before_importing_torch(argv, item):
    (rc, imported), stderr = _fresh(COMMAND.format(argv=[*argv, "--set", item], heavy=HEAVY))
    assert rc == "rc 2"
    assert item.split("=")[0].split(".")[-1] in stderr and stderr.startswith("error: ")
    assert imported == "[]"


def test_tiny_lm_keys_are_the_models_own_keyword_arguments():
    params = inspect.signature(TinyLM.__init__).parameters.values()
    assert set(TINY_LM_KEYS) == {p.name for p in params if p.kind is p.KEYWORD_ONLY}


def test_every_tiny_lm_key_passes_the_config_and_other_models_keep_their_own_keys():
    """The check refuses only keys tiny-lm does not take; a value is the model's to judge when it is built."""
    given = {k: 3 for k in TINY_LM_KEYS}
    cfg = load_config(None, [f"model.{k}={v}" for k, v in given.items()])
    assert cfg.model.kwargs() == given
    assert load_config(None, ["model.name=mymodels:factory", "model.dimm=3"]).model.kwargs() == {"dimm": 3}
