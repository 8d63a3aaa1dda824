"""steadytrain: the parts of PyTorch training that quietly break runs, right by construction.

``from steadytrain import Run`` gives your own loop the trainer's run directory (:class:`steadytrain.loop.run.Run`);
it is imported on first use, so ``import steadytrain`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._version import __version__

if TYPE_CHECKING:
    from steadytrain.loop.run import Run

__all__ = ["Run", "__version__"]


def __getattr__(name: str) -> object:
    if name == "Run":
        from steadytrain.loop.run import Run

        return Run
    raise AttributeError(f"module 'steadytrain' has no attribute {name!r}")
