"""Tensor parallelism: the model's plan applied over the mesh's ``tp`` dimension, before anything else wraps it.

Where a plan comes from, in order:

- the model's own ``tp_plan(mesh)`` method, returning a ``parallelize_module`` plan (``{module path: ParallelStyle}``,
  ``*`` matching any one path atom): tiny-lm has one (:meth:`~steadytrain.train.setup.models.TinyLM.tp_plan`), and a
  user's model may;
- for ``hf:`` models, ``transformers``' own plan for the architecture (its config's ``base_model_tp_plan``:
  ``colwise``/``rowwise`` styles), refused in one line when the architecture has none;
- otherwise refused in one line.

The order of wrapping follows torchtitan: tensor parallel, then activation checkpointing, then compile, then
``fully_shard`` over the ``(replicate, shard)`` submesh (:func:`~steadytrain.train.setup.distributed.wrap_model`).
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch
from typing import Any

from torch import nn

from steadytrain._text import brief, error_text
from steadytrain.errors import UserError
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["MeshSize", "apply_tensor_parallel", "check_plan", "hf_plan", "plan_of"]

log = logging.getLogger("steadytrain.train")

_HF_STYLES = ("colwise", "rowwise")


def hf_plan(model: Any, tp: int) -> dict[str, Any]:
    """``transformers``' tensor-parallel plan of an ``hf:`` model (:class:`~steadytrain.train.hf.model.HFCausalLM`),
    as ``parallelize_module`` styles under the wrapper's module paths."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config, inner = model.config, model.hf
    name = getattr(config, "model_type", type(inner).__name__)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise UserError(
            f"model hf:{name} has no tensor-parallel plan in transformers (its config's base_model_tp_plan is empty): "
            "use a Llama-style architecture (e.g. hf:llama), or distributed.mesh.tp=1"
        )
    odd = sorted({style for style in plan.values() if style not in _HF_STYLES})
    if odd:
        raise UserError(
            f"model hf:{name}'s tensor-parallel plan uses {', '.join(odd)}, which steadytrain does not map "
            f"(it maps {' and '.join(_HF_STYLES)}): use a Llama-style architecture, or distributed.mesh.tp=1"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise UserError(
                f"model.{key}={heads} does not split over distributed.mesh.tp={tp}: give model.{key} a multiple of "
                f"{tp}, or a tp that divides {heads}"
            )
    prefix = "hf." + (f"{inner.base_model_prefix}." if getattr(inner, "base_model_prefix", "") else "")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {prefix + path: styles[style]() for path, style in plan.items()}


class MeshSize:
    """A stand-in for a 1-D mesh of ``n`` ranks that has only its ``size()``: what the built-in plans read, so they
    can be checked before any rank starts (:func:`check_plan`)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self, dim: int | None = None) -> int:
        return self.n


def _own_plan(model: nn.Module, own: Any, mesh: Any) -> dict[str, Any]:
    """The model's own ``tp_plan(mesh)``, checked: a dict of module path (str) -> ParallelStyle instance."""
    from torch.distributed.tensor.parallel import ParallelStyle

    where = f"{type(model).__name__}.tp_plan(mesh)"
    try:
        plan = own(mesh)
    except UserError:
        raise
    except Exception as err:  # the user's method failed: name it, as a failing model factory is named
        raise UserError(f"{where} raised {type(err).__name__}: {error_text(err)}") from None
    fix = "return a dict of module path -> ParallelStyle (torch.distributed.tensor.parallel)"
    if not isinstance(plan, dict) or not plan:
        raise UserError(f"{where} returned {'an empty dict' if isinstance(plan, dict) else type(plan).__name__}: {fix}")
    for key, style in plan.items():
        if not isinstance(key, str):
            raise UserError(f"{where} returned the key {brief(key)} ({type(key).__name__}), not a module path: {fix}")
        if not isinstance(style, ParallelStyle):
            shown = f"the class {style.__name__}" if isinstance(style, type) else type(style).__name__
            raise UserError(
                f"{where} maps {key!r} to {shown}, not a ParallelStyle instance: {fix} (e.g. ColwiseParallel())"
            )
    return plan


def plan_of(model: nn.Module, mesh: Any) -> dict[str, Any]:
    """The tensor-parallel plan of ``model`` over the 1-D ``mesh`` (see the module's docstring for where it comes
    from); a UserError in one line when there is none, or when the model's own is not a plan."""
    from steadytrain.train.hf.model import HFCausalLM

    own = getattr(model, "tp_plan", None)
    if callable(own):
        return _own_plan(model, own, mesh)
    if own is not None:
        raise UserError(
            f"{type(model).__name__}.tp_plan is a {type(own).__name__}, not a method: define tp_plan(self, mesh) "
            "returning the plan, or set distributed.mesh.tp=1"
        )
    if isinstance(model, HFCausalLM):
        return hf_plan(model, mesh.size())
    raise UserError(
        f"model {type(model).__name__} has no tensor-parallel plan: give it a tp_plan(mesh) method returning a "
        "parallelize_module plan, or set distributed.mesh.tp=1"
    )


def check_plan(model: nn.Module, tp: int) -> None:
    """Before any rank starts: a built-in model's plan over ``tp`` ranks (tiny-lm's heads split, transformers has a
    plan) and its keys name modules of ``model`` (which may be on the meta device); a user's model that has no
    ``tp_plan`` method at all (what the ranks would each refuse, known without a mesh). A user's own ``tp_plan`` is
    called on the real mesh only (it may ask the mesh for more than its size)."""
    from steadytrain.train.hf.model import HFCausalLM
    from steadytrain.train.setup.models import TinyLM

    if tp <= 1:
        return
    if type(model) in (TinyLM, HFCausalLM):  # a subclass may override tp_plan: real mesh only
        _check_keys(model, plan_of(model, MeshSize(tp)))
    elif not isinstance(model, HFCausalLM) and not callable(getattr(model, "tp_plan", None)):
        plan_of(model, MeshSize(tp))  # no plan, or tp_plan not a method: the ranks' own one-line refusal, said once


def _check_keys(model: nn.Module, plan: dict[str, Any]) -> None:
    """Every key of ``plan`` names at least one module of ``model`` (``*`` and the other ``fnmatch`` patterns match
    one path atom each, as ``parallelize_module`` matches them): a key that matches nothing would be skipped."""
    names = [name.split(".") for name, _ in model.named_modules()]
    for key in plan:
        atoms = key.split(".")
        if not any(len(n) == len(atoms) and all(map(fnmatch, n, atoms)) for n in names):
            raise UserError(
                f"tensor-parallel plan names {key!r}, which matches no module of {type(model).__name__}: "
                "plan keys are module paths as named_modules() gives them (* matches one part)"
            )


def apply_tensor_parallel(model: nn.Module, info: DistInfo) -> nn.Module:
    """Split ``model``'s layers over the mesh's ``tp`` dimension by its plan (in place; as is when ``tp`` is 1).
    Every rank holds the same seeded weights, so each keeps its slice of equal tensors."""
    if info.tp == 1 or info.mesh is None:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = info.mesh["tp"]
    plan = plan_of(model, mesh)
    _check_keys(model, plan)
    model = model.to(info.device)
    try:
        parallelize_module(model, mesh, plan)
    except UserError:
        raise
    except Exception as err:  # torch's refusal, or a user's ParallelStyle failing: the same on every rank
        raise UserError(
            f"tensor-parallel plan of {type(model).__name__} does not apply: {type(err).__name__}: {error_text(err)}"
        ) from None
    if info.is_main:
        log.info("tensor parallel: %d modules split over tp=%d", len(plan), info.tp)
    return model
