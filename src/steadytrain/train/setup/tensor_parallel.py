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
from typing import Any

from torch import nn

from steadytrain.errors import UserError
from steadytrain.train.setup.distributed import DistInfo

__all__ = ["apply_tensor_parallel", "hf_plan", "plan_of"]

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
            raise UserError(f"model.{key}={heads} does not split over distributed.mesh.tp={tp}: give a multiple of it")
    prefix = "hf." + (f"{inner.base_model_prefix}." if getattr(inner, "base_model_prefix", "") else "")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {prefix + path: styles[style]() for path, style in plan.items()}


def plan_of(model: nn.Module, mesh: Any) -> dict[str, Any]:
    """The tensor-parallel plan of ``model`` over the 1-D ``mesh`` (see the module's docstring for where it comes
    from); a UserError in one line when there is none."""
    from steadytrain.train.hf.model import HFCausalLM

    own = getattr(model, "tp_plan", None)
    if callable(own):
        plan = own(mesh)
        if not isinstance(plan, dict) or not plan:
            got = type(plan).__name__ if not isinstance(plan, dict) else "an empty dict"
            raise UserError(
                f"{type(model).__name__}.tp_plan(mesh) returned {got}: return a dict of module path -> "
                "ParallelStyle (torch.distributed.tensor.parallel)"
            )
        return plan
    if isinstance(model, HFCausalLM):
        return hf_plan(model, mesh.size())
    raise UserError(
        f"model {type(model).__name__} has no tensor-parallel plan: give it a tp_plan(mesh) method returning a "
        "parallelize_module plan, or set distributed.mesh.tp=1"
    )


def apply_tensor_parallel(model: nn.Module, info: DistInfo) -> nn.Module:
    """Split ``model``'s layers over the mesh's ``tp`` dimension by its plan (in place; as is when ``tp`` is 1).
    Every rank holds the same seeded weights, so each keeps its slice of equal tensors."""
    if info.tp == 1 or info.mesh is None:
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = info.mesh["tp"]
    plan = plan_of(model, mesh)
    names = {name for name, _ in model.named_modules()}
    missing = [k for k in plan if "*" not in k and k not in names]
    if missing:
        raise UserError(
            f"tensor-parallel plan names {missing[0]!r}, which is not a module of {type(model).__name__}: "
            "plan keys are module paths as named_modules() gives them"
        )
    model = model.to(info.device)
    try:
        parallelize_module(model, mesh, plan)
    except (ValueError, RuntimeError, AttributeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"tensor-parallel plan of {type(model).__name__} does not apply: {first}") from None
    if info.is_main:
        log.info("tensor parallel: %d modules split over tp=%d", len(plan), info.tp)
    return model
