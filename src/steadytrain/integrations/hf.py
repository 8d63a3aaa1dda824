"""A Hugging Face ``Trainer`` writing a steadytrain run directory: ``SteadytrainCallback``, and its companion.

Usage (the companion line is optional: it traces non-finite steps to examples)::

    from steadytrain.integrations.hf import SteadytrainCallback, SteadytrainLossMixin
    class MyTrainer(SteadytrainLossMixin, Trainer): ...  # items carry an "example_id"; remove_unused_columns=False
    MyTrainer(model, args, train_dataset=ds, callbacks=[SteadytrainCallback("runs/hf-1", shard_size=1000)]).train()

The Trainer keeps its own backward, clipping and optimizer step; the callback watches them from the Trainer's
events and writes through steadytrain's own writers (an open :class:`steadytrain.Run`,
:mod:`steadytrain.loop.external`): ``config.yaml`` (your ``config``, and the ``TrainingArguments`` under
``training_arguments``: their ``optim`` is not steadytrain's ``optim`` section), ``plan.json``, ``env.json``;
``metrics.jsonl``, one row per Trainer log (``logging_steps=1``: one per optimizer step): the Trainer's logged
``loss`` (its mean since its previous log), ``learning_rate`` as ``lr``, ``grad_norm`` (its pre-clip norm of the
logged step), ``skipped``, and the time and items of the steps the row stands for; an evaluation's
``eval_loss`` as a ``val_loss`` row; ``layers.jsonl`` (``layers=True``) at the steps the Trainer logs whose
number is a multiple of ``layers_every`` (default ``log_every``): the gradients are read at
``on_pre_optimizer_step``, after the Trainer's clip, and scaled back by its factor (the Trainer's logged norm over
the callback's), so they are pre-clip as steadytrain's trainer writes them; ``nonfinite.jsonl`` and
``exposure.json``; at train end ``summary.md`` and ``plots/``.

What it can prevent. At ``on_pre_optimizer_step`` the callback reads the global norm of the gradients the
optimizer is about to apply (one host read per step; with several ranks, one small all-reduce of the verdict).
When it is not finite (the Trainer's clip leaves a NaN norm's gradients NaN), or when the companion saw a
non-finite loss in the step, the step is refused (``on_nonfinite="skip"``, the default): the callback sets every
gradient to None, so the Trainer's ``optimizer.step()`` applies nothing (torch's optimizers, AdamW, SGD and
Adafactor among them, leave a parameter without a gradient and its moments untouched), and records the step in
``nonfinite.jsonl`` with the examples in play. ``on_nonfinite="raise"`` records it and stops training there
(:class:`~steadytrain.accumulate.NonFiniteGradientError`); ``"ignore"`` lets the Trainer step.

What it cannot. The Trainer still calls ``optimizer.step()`` (an optimizer that changes parameters without a
gradient still does), steps its LR scheduler (a refused step uses up one step of the schedule) and counts the step
in ``global_step``; its own logged loss replaces a NaN micro-batch loss by a running mean
(``logging_nan_inf_filter``): the row's ``loss`` is null where the companion saw one. Without the companion it
does not know the examples (the ledger has no shards: ``nan report`` cannot attribute), nor a non-finite loss
whose gradients stayed finite. Gradients a framework keeps outside ``.grad`` (DeepSpeed) it neither sees nor
clears. If ``trainer.train()`` raises, call ``callback.close(error)`` to finish the run directory.

The companion :class:`SteadytrainLossMixin` reads each micro-batch's ``example_id`` column (removed before the
model sees the batch; the Trainer must keep it: ``TrainingArguments(remove_unused_columns=False)`` and a collator
that carries it), lets the Trainer compute its loss as usual, computes each example's loss for a causal LM (no
gradient; override :meth:`SteadytrainLossMixin.example_losses` for another model), and gives both to
:meth:`SteadytrainCallback.micro_batch`. Example ``i`` is index ``i % shard_size`` of shard ``i // shard_size``.

``transformers`` is imported when ``SteadytrainCallback`` is first read, not with this module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from steadytrain.errors import UserError
from steadytrain.integrations._hf_recorder import Recorder

__all__ = ["SteadytrainCallback", "SteadytrainLossMixin"]


def __getattr__(name: str) -> Any:
    if name == "SteadytrainCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _callback_class() -> type:
    """``SteadytrainCallback``: the recorder as a ``transformers.TrainerCallback`` (transformers imported now)."""
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise UserError("SteadytrainCallback needs Hugging Face transformers: pip install 'steadytrain[hf]'") from None
    attrs = {"__module__": __name__, "__doc__": Recorder.__doc__, "__qualname__": "SteadytrainCallback"}
    return type("SteadytrainCallback", (Recorder, TrainerCallback), attrs)


if TYPE_CHECKING:
    from transformers import TrainerCallback

    class SteadytrainCallback(Recorder, TrainerCallback): ...


class SteadytrainLossMixin:
    """The companion of :class:`SteadytrainCallback`: put it before ``Trainer`` (``class MyTrainer(
    SteadytrainLossMixin, Trainer)``). Each training micro-batch's ``example_id`` column (integers) is taken out
    of the batch, the Trainer computes its loss as usual, and the callback gets the ids, each example's loss
    (:meth:`example_losses`) and the loss. Evaluation batches only lose the column."""

    example_id_key = "example_id"

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:  # fmt: skip
        ids = inputs.pop(self.example_id_key, None)
        if not model.training:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if ids is None:
            raise UserError(
                f"SteadytrainLossMixin: the batch has no {self.example_id_key!r}: give each example one and keep it "
                "(TrainingArguments(remove_unused_columns=False), a collator that carries it)"
            )
        labels = inputs.get("labels")
        loss, outputs = super().compute_loss(  # type: ignore[misc]
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        losses = self.example_losses(outputs, labels) if labels is not None else None
        _callback_of(self).micro_batch(ids, losses=losses, loss=loss)
        return (loss, outputs) if return_outputs else loss

    def example_losses(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """Each example's mean loss over its targets, for a causal LM (the model's own shift: position ``t``
        predicts label ``t + 1``; ``-100`` is no target; an example without targets has loss 0), without a
        gradient. Override it for another kind of model."""
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[1]
        with torch.no_grad():
            logits, targets = logits[:, :-1].float(), labels[:, 1:].to(logits.device)
            each = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            kept = (targets != -100).float()
            return (each * kept).sum(1) / kept.sum(1).clamp(min=1.0)


def _callback_of(trainer: Any) -> Recorder:
    """The trainer's :class:`SteadytrainCallback` (one line of error when it has none)."""
    found = getattr(trainer, "_steadytrain_callback", None)
    if found is None:
        found = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Recorder)), None)
        if found is None:
            raise UserError(
                "SteadytrainLossMixin: the Trainer has no SteadytrainCallback: add "
                "callbacks=[SteadytrainCallback(run_dir)]"
            )
        trainer._steadytrain_callback = found
    return found
