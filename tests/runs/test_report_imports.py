"""``steadytrain report`` draws a finished run without importing what it does not use: not torch, pyarrow or
transformers (matplotlib, which draws, is imported). Checked in a fresh interpreter, where ``sys.modules`` shows
what the command imported."""

from __future__ import annotations

import subprocess
import sys

from tests.runs.test_hardening_runs import PLOTS, fake_run

PROBE = """
import sys
from steadytrain.cli import main
rc = main(["report", {run!r}])
print(rc, sorted(m for m in ("torch", "pyarrow", "transformers", "matplotlib") if m in sys.modules))
"""


def test_report_draws_a_run_without_importing_torch(tmp_path):
    run = fake_run(tmp_path / "run")
    code = PROBE.format(run=str(run))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 ['matplotlib']"
    assert sorted(p.stem for p in (run / "plots").glob("*.png")) == sorted(PLOTS)
    assert "| optimizer steps | 6 of 6 planned |" in (run / "summary.md").read_text()
