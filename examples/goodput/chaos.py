"""``run.callbacks: [chaos:hooks]`` for the account in docs/goodput.md: three faults planted in a 2-rank run.

Each fault happens once (a marker file in ``$CHAOS_DIR``): rank 0 is killed with SIGKILL at the end of step 27 (a
lost node: torchrun restarts the ranks), rank 1 stops at the end of step 63 (a stuck collective: the hang watchdog
ends the attempt). Every step also sleeps 0.1 s, the work of a model larger than the demo's.
"""

import os
import signal
import time
from pathlib import Path

MARK = Path(os.environ.get("CHAOS_DIR", "."))


class Hooks:
    def on_step_end(self, run):
        time.sleep(0.1)
        rank = os.environ.get("RANK", "0")
        if rank == "0" and run.step == 27 and not (MARK / "killed").exists():
            (MARK / "killed").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == "1" and run.step == 63 and not (MARK / "hung").exists():
            (MARK / "hung").write_text("")
            time.sleep(600)


def hooks():
    return Hooks()
