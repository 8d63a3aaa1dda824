"""Per-layer health: gradient, weight and update norms per layer, correct under any sharding (``layers.jsonl``).

A layer (``monitor.group``) is, with ``auto``, one block of the model's main ``ModuleList`` (the one holding most
parameters; ``blocks.3``, ``model.layers.3``) or one other part beside it (``tok``, ``pos``, ``norm``, ``head``;
``model.embed_tokens``, ``lm_head``); with ``module``, each module that holds parameters; with ``parameter``, each
parameter. Wrappers' names (DDP's ``module.``, compile's ``_orig_mod.``, activation checkpointing's) are left out; a
part of the user's own model named ``module`` stays (it is the model's, not a wrapper's).

On a monitored step (every ``monitor.every_steps`` optimizer steps, and every refused step) the accumulator shows
the monitor the gradients before clipping and the parameters after the update. Each parameter's norms are taken
over what this rank holds of it (:func:`steadytrain.clip.local_norms`), then made whole-tensor norms with one
reduction for the gradient, weight and update norms together (:func:`steadytrain.clip.combine_norms`: one
collective under FSDP2, none under DDP, whose replicas are whole); a layer's norm is the square root of the sum
of its parameters' squared norms, so the layers' gradient norms combine to the step's global ``grad_norm``. One
host read per monitored step; nothing at all on other steps. The update is the parameters after the step minus
before it (a copy of this rank's shards is kept during the update, on monitored steps only); a refused step has
no update (``update_norm`` and ``update_ratio`` null).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from steadytrain._dtensor import local
from steadytrain.clip import combine_norms, local_norms
from steadytrain.train.observe.throughput import unwrap

__all__ = ["KEYS", "LayerMonitor", "layer_of", "tracker_fields", "tracker_names"]

KEYS = ("grad_norm", "param_norm", "update_norm", "update_ratio")
"""The values of a ``layers.jsonl`` row, besides ``step`` and ``layer``."""

_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
"""Parts a wrapper puts inside a parameter's name (compile, activation checkpointing, FSDP1). DDP's ``module.`` is
not among them: a user's model may have a part of that name; DDP itself is unwrapped (:func:`unwrap`)."""
_NOT_IN_KEYS = re.compile(r"[^\w\-. ]")
"""Characters every tracker takes in a key's part (MLflow's set, less ``/``, which separates the parts)."""


def _clean(name: str) -> str:
    """A parameter's name in the user's model: the wrappers' parts left out."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _main_list(model: nn.Module) -> str | None:
    """The dotted path of the model's ``ModuleList`` holding most parameters (None: the model has none)."""
    best, size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (n := sum(p.numel() for p in mod.parameters())) > size:
            best, size = _clean(name), n
    return best


def layer_of(name: str, group: str, main: str | None) -> str:
    """The layer parameter ``name`` (cleaned) belongs to under ``group``; ``main``: :func:`_main_list`'s path."""
    if group == "parameter":
        return name
    parts = name.split(".")
    if group == "module" or len(parts) == 1:
        return ".".join(parts[:-1]) or name
    if main is not None and name.startswith(main + "."):
        return ".".join(parts[: len(main.split(".")) + 1])  # blocks.3
    parent = main.split(".")[:-1] if main else []
    common = 0
    while common < len(parent) and common < len(parts) - 1 and parts[common] == parent[common]:
        common += 1
    return ".".join(parts[: min(common + 1, len(parts) - 1)])  # a part beside the blocks: tok, model.norm, lm_head


class LayerMonitor:
    """Watches the accumulator's cycles (its ``observer``) and keeps the rows of ``layers.jsonl`` until taken."""

    def __init__(self, model: nn.Module, group: str, every: int, next_step: Callable[[], int]) -> None:
        model = unwrap(model)  # DDP's module. (and a whole-model compile's _orig_mod.): the names are the user's
        main = _main_list(model) if group == "auto" else None
        self._names = {id(p): layer_of(_clean(n), group, main) for n, p in model.named_parameters()}
        self.every, self.next_step = every, next_step
        self.rows: list[dict[str, Any]] = []
        """Rows not yet written (:meth:`take`)."""
        self.last: list[dict[str, Any]] = []
        """The rows of the last monitored step."""
        self._index: tuple[list[str], Tensor] | None = None
        self._grads: Tensor | None = None
        self._factor: Tensor | float = 1.0
        self._before: list[Tensor] | None = None

    def observes(self, refused: bool) -> bool:
        """Whether this cycle is watched: a monitored step, or a refused one (what its layers saw is kept)."""
        return refused or self.next_step() % self.every == 0

    @torch.no_grad()
    def before_update(self, params: list[Tensor], factor: Tensor | float, stepped: bool) -> None:
        """This rank's part of each gradient's norm (before clipping); a copy of the parameters when they will be
        updated."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self._grads, self._factor = local_norms(grads).float(), factor
        self._before = torch._foreach_mul([local(p).detach() for p in params], 1.0) if stepped else None  # a copy

    @torch.no_grad()
    def after_update(self, params: list[Tensor]) -> None:
        """The layers' norms of this step: one reduction, one host read; the rows are kept for :meth:`take`."""
        names, index = self._layers(params)
        parts = [self._grads, local_norms(params).float()]
        if self._before is not None:  # the copy becomes the update (its sign is no matter to a norm): no new memory
            torch._foreach_sub_(self._before, [local(p).detach() for p in params])
            parts.append(local_norms(self._before).float())
        norms = combine_norms(torch.stack(parts), params)
        squares = torch.zeros(len(parts), len(names), dtype=torch.float64, device=norms.device)
        squares.index_add_(1, index, norms.double().square())
        values = squares.sqrt()
        values[0] *= self._factor.abs().double() if isinstance(self._factor, Tensor) else abs(self._factor)
        got = values.tolist()  # the one host read of a monitored step
        self._grads = self._before = None
        step = self.next_step()
        self.last = [_row(step, name, *(column[i] for column in got)) for i, name in enumerate(names)]
        self.rows.extend(self.last)

    def _layers(self, params: list[Tensor]) -> tuple[list[str], Tensor]:
        """The layers in model order and each parameter's layer number (built once: the parameters stay)."""
        if self._index is None:
            names = [self._names.get(id(p), f"param{i}") for i, p in enumerate(params)]
            order = list(dict.fromkeys(names))
            number = {n: i for i, n in enumerate(order)}
            device = local(params[0]).device
            self._index = (order, torch.tensor([number[n] for n in names], device=device))
        return self._index

    def take(self) -> list[dict[str, Any]]:
        """The rows kept since the last call, in step and model order."""
        rows, self.rows = self.rows, []
        return rows

    def rolled_back(self, step: int, rollback: int) -> list[dict[str, Any]]:
        """The rows of the spike at ``step`` that rollback number ``rollback`` went back from: kept in the file (the
        rows after the checkpoint are cut), marked as the metrics row of a rollback is."""
        self.rows = [r for r in self.rows if r["step"] < step]  # not written yet: the tagged copy replaces them
        return [r | {"rollback": rollback} for r in self.last if r["step"] == step]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _row(step: int, layer: str, grad: float, param: float, update: float | None = None) -> dict[str, Any]:
    grad, param, update = _finite(grad), _finite(param), _finite(update)
    ratio = update / param if update is not None and param else None
    return {"step": step, "layer": layer, "grad_norm": grad, "param_norm": param, "update_norm": update,
            "update_ratio": ratio}  # fmt: skip


def tracker_names(layers: list[str]) -> dict[str, str]:
    """Each layer's part of a tracker key: its name, where a character a tracker refuses in a key (MLflow: a quote, a
    newline; ``/`` would split the key) is ``_``, and distinct: a name changed so comes after the names kept, with
    ``_2``, ``_3``... when taken (two layers never share a key, whose values would overwrite each other's).

    Example:
        >>> tracker_names(["blocks.0", 'parts.a"b', "parts.a/b", "parts.a_b"])
        {'blocks.0': 'blocks.0', 'parts.a_b': 'parts.a_b', 'parts.a"b': 'parts.a_b_2', 'parts.a/b': 'parts.a_b_3'}
    """
    out = {layer: layer for layer in layers if not _NOT_IN_KEYS.search(layer)}
    taken = set(out)
    for layer in (x for x in layers if x not in out):
        base = name = _NOT_IN_KEYS.sub("_", layer)
        n = 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        out[layer] = name
        taken.add(name)
    return out


def tracker_fields(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """``{step: {"layers/<layer>/<key>": value}}`` for the experiment trackers (null values left out; ``<layer>``:
    :func:`tracker_names`)."""
    names = tracker_names(list(dict.fromkeys(r["layer"] for r in rows)))
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        fields = out.setdefault(r["step"], {})
        fields.update({f"layers/{names[r['layer']]}/{k}": r[k] for k in KEYS if r.get(k) is not None})
    return out
