"""Looking at run directories: report and plots, compare two runs, reproduce a run here, sweep the LR.

``report`` reads a run; ``compare`` reads two; ``repro`` and ``sweep`` re-run ``train``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.runs.compare import Comparison, compare
    from steadytrain.runs.record import RunRecord, load_run
    from steadytrain.runs.report import Report, report
    from steadytrain.runs.repro import Repro, repro
    from steadytrain.runs.sweep import Sweep, sweep

__all__ = ["Comparison", "Report", "Repro", "RunRecord", "Sweep", "compare", "load_run", "report", "repro", "sweep"]

# each name's submodule, imported on the name's first use: `steadytrain report` does not import the training loop
export_lazily(
    __name__,
    {
        "Comparison": "compare",
        "compare": "compare",
        "RunRecord": "record",
        "load_run": "record",
        "Report": "report",
        "report": "report",
        "Repro": "repro",
        "repro": "repro",
        "Sweep": "sweep",
        "sweep": "sweep",
    },
)
