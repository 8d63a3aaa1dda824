"""Looking at run directories: report and plots, compare two runs, reproduce a run here, sweep the LR.

``report`` reads a run; ``compare`` reads two; ``repro`` and ``sweep`` re-run ``train``.
"""

from steadytrain.runs.compare import Comparison, compare
from steadytrain.runs.record import RunRecord, load_run
from steadytrain.runs.report import Report, report
from steadytrain.runs.repro import Repro, repro
from steadytrain.runs.sweep import Sweep, sweep

__all__ = ["Comparison", "Report", "Repro", "RunRecord", "Sweep", "compare", "load_run", "report", "repro", "sweep"]
