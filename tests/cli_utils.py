"""What the command-line tests share: the installed command and the shape of a user error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).with_name("steadytrain"))


def assert_user_error(proc: subprocess.CompletedProcess, *words: str, code: int = 2) -> None:
    """Exit ``code``, exactly one line on stderr holding every one of ``words``, no traceback."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
