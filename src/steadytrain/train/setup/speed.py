"""Speed settings of ``steadytrain train``: activation checkpointing and ``torch.compile``, per block.

Both apply to the model's blocks: the ``nn.ModuleList`` that :func:`find_blocks` finds (the one with
the most parameters) or ``model.ac_blocks`` names. They are applied in place, before DDP or FSDP2
wrap the model, in the order torchtitan uses (``parallelize_llama``): activation checkpointing, then
compile per block, then ``fully_shard``/DDP. In place means every parameter keeps its name (no
``_orig_mod.`` or ``_checkpoint_wrapped_module.`` in it), so checkpoints, exports and resumes look the
same with either setting on or off, and a resume may switch them.

- Activation checkpointing: a checkpointed block keeps only its inputs for the backward and runs its
  forward again there (``torch.utils.checkpoint.checkpoint``, ``use_reentrant=False``; the RNG state is
  replayed, so dropout draws the same masks). The block's class is swapped for a subclass whose
  ``forward`` does this (as FSDP2's ``fully_shard`` swaps classes), so extra arguments such as an
  attention mask pass through and the module stays where it was.
- Compile: ``nn.Module.compile`` on each block (or on the whole model when it has no blocks). Identical
  blocks share one compiled graph. The compile is lazy: it happens at each module's first call, where
  the backward is compiled too (not at the first backward), so every compile error surfaces in a
  forward call. There a compile error (a ``torch._dynamo`` error: ``BackendCompilerFailed``,
  ``Unsupported``, a missing C++ compiler) is told from an error of the model itself by running the
  same call eagerly: if that fails too, its error is raised as it would be without compile; if not,
  ``model.compile_fallback=true`` continues eagerly (one warning) and otherwise the run stops with one
  :class:`~steadytrain.errors.UserError` line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from steadytrain._text import error_text
from steadytrain.errors import UserError

__all__ = [
    "CompiledModel",
    "apply_activation_checkpointing",
    "check_blocks",
    "compile_model",
    "find_blocks",
    "speed_up",
]

log = logging.getLogger("steadytrain.train")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, attr: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's blocks: ``(name, module_list)``, or None when it holds no ``nn.ModuleList``.

    Args:
        model: the unwrapped model.
        attr: ``model.ac_blocks``, the (dotted) attribute name of the blocks, e.g. ``transformer.h``;
            None: the ``nn.ModuleList`` with the most parameters among the model's descendants.

    Raises:
        UserError: ``attr`` names no ``nn.ModuleList``, or two lists tie for the most parameters.

    Example:
        >>> from steadytrain.train.setup.models import TinyLM
        >>> find_blocks(TinyLM(dim=8, layers=2, heads=2, seq_len=8))[0]
        'blocks'
    """
    cls = type(model).__name__
    if attr is not None:
        try:
            found: Any = model.get_submodule(attr)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList):
            what = "absent" if found is None else f"a {type(found).__name__}"
            raise UserError(
                f"model.ac_blocks={attr!r}: {cls}.{attr} is {what}, not an nn.ModuleList: give the attribute "
                "that holds the model's blocks (e.g. blocks, layers, transformer.h), or remove model.ac_blocks"
            )
        return attr, found
    lists = [(name, m) for name, m in model.named_modules() if name and isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return None
    most = max(_numel(m) for _, m in lists)
    top = [(name, m) for name, m in lists if _numel(m) == most]
    if len(top) > 1:
        names = ", ".join(name for name, _ in top)
        raise UserError(
            f"model.ac_blocks: {cls} has {len(top)} nn.ModuleLists of {most} parameters ({names}): "
            "name the blocks with model.ac_blocks"
        )
    return top[0]


def check_blocks(model: nn.Module, mc: Any) -> nn.ModuleList | None:
    """The blocks the model section's speed settings apply to (``mc``: the config's ``model``); a UserError
    when activation checkpointing or ``model.ac_blocks`` needs blocks the model does not have. Works on the
    meta device (:func:`~steadytrain.train.setup.pieces.check_model_args` calls it before any run directory)."""
    if mc.activation_checkpointing == "none" and not mc.compile and mc.ac_blocks is None:
        return None
    found = find_blocks(model, mc.ac_blocks)
    if found is None and mc.activation_checkpointing != "none":
        raise UserError(
            f"model.activation_checkpointing={mc.activation_checkpointing}: no nn.ModuleList of blocks found in "
            f"{type(model).__name__}: name it with model.ac_blocks"
        )
    return None if found is None else found[1]


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """``cls`` with a ``forward`` that checkpoints the original one (one subclass per class)."""
    if cls not in _CHECKPOINTED:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(super(new, self).forward, *args, use_reentrant=False, **kwargs)

        new = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_steadytrain_checkpointed": True})
        _CHECKPOINTED[cls] = new
    return _CHECKPOINTED[cls]


def apply_activation_checkpointing(
    model: nn.Module, mode: str, every: int = 2, attr: str | None = None, blocks: nn.ModuleList | None = None
) -> int:
    """Checkpoint the blocks of ``model`` in place: all of them (``full``), every ``every``-th one from the
    first (``selective``: blocks ``i`` with ``i % every == 0``), or none; the number checkpointed.

    Args:
        model: the unwrapped model.
        mode: ``model.activation_checkpointing``: ``none``, ``full`` or ``selective``.
        every: ``model.ac_every``.
        attr: ``model.ac_blocks`` (see :func:`find_blocks`).
        blocks: the blocks, when already found (``attr`` is then not used).

    Raises:
        UserError: ``mode`` is not ``none`` and the model has no blocks (see :func:`find_blocks`).
    """
    if mode == "none":
        return 0
    if blocks is None:
        blocks = check_blocks(model, _Speed(activation_checkpointing=mode, ac_blocks=attr))
    chosen = [b for i, b in enumerate(blocks) if mode == "full" or i % every == 0]
    for block in chosen:
        if not getattr(block, "_steadytrain_checkpointed", False):
            block.__class__ = _checkpointed_class(type(block))
    return len(chosen)


@dataclass
class _Speed:
    """The speed keys of the config's ``model`` section, for calls outside a run."""

    activation_checkpointing: str = "none"
    ac_every: int = 2
    ac_blocks: str | None = None
    compile: bool = False
    compile_fallback: bool = False


@dataclass
class CompiledModel:
    """What :func:`compile_model` compiled and how long the compile took."""

    what: str
    """``3 block(s)`` or ``the whole model``."""
    modules: list[nn.Module]
    name: str
    """The model's name in messages (``model.name``)."""
    fallback: bool
    """``model.compile_fallback``: a compile error continues eagerly instead of stopping the run."""
    announce: bool = True
    """Log the compile time and a fallback (rank 0)."""
    seconds: float = 0.0
    """The first calls' wall time, which is the compile (forward and backward graphs)."""
    eager: bool = False
    """Compiling failed and the model runs eagerly."""
    _waiting: set[int] = field(default_factory=set)

    def first_call(self, module: nn.Module, seconds: float) -> None:
        self.seconds += seconds
        self._waiting.discard(id(module))
        if not self._waiting and self.announce:
            log.info("compiled %s in %.1f s", self.what, self.seconds)

    def failed(self, err: Exception, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The eager result of the call that failed to compile (a UserError without ``compile_fallback``)."""
        out = module._call_impl(*args, **kwargs)  # an error of the model itself raises here, as without compile
        line = _first_line(err)
        if not self.fallback:
            raise _not_compiled(self.name, line)
        self.to_eager(line)
        return out

    def to_eager(self, line: str) -> None:
        """Run every compiled module eagerly from now on; warn once."""
        for m in self.modules:
            m._compiled_call_impl = None  # what nn.Module.compile set: None is the eager call
        if not self.eager and self.announce:
            log.warning("model.compile: %s could not be compiled (%s): training eagerly", self.name, line)
        self.eager, self._waiting = True, set()


def _not_compiled(name: str, line: str) -> UserError:
    return UserError(
        f"model.compile: {name} could not be compiled ({line}): set model.compile_fallback=true to train eagerly, "
        "or model.compile=false"
    )


def _first_line(err: BaseException) -> str:
    line = next((s.strip() for s in str(err).splitlines() if s.strip()), type(err).__name__)
    return error_text(RuntimeError(line), limit=300)


def _guard(handle: CompiledModel, module: nn.Module, compiled: Any) -> Any:
    """``compiled`` (the module's compiled call) timed on its first call, its compile errors handled."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._functorch import config as aot_config

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            # compile the backward with the forward: a compile error then always surfaces here, in a forward
            with aot_config.patch(force_non_lazy_backward_lowering=True):
                out = compiled(*args, **kwargs)
        except TorchDynamoException as err:  # dynamo's and inductor's errors (and the model's, traced)
            return handle.failed(err, module, args, kwargs)
        if id(module) in handle._waiting:
            handle.first_call(module, time.perf_counter() - start)
        return out

    return call


def compile_model(
    model: nn.Module, blocks: nn.ModuleList | None = None, *, name: str = "the model", fallback: bool = False,
    announce: bool = True,
) -> CompiledModel:  # fmt: skip
    """``torch.compile`` each of ``blocks`` in place (or the whole ``model`` when None); lazy: the compile
    happens at the first forward (see the module docstring, also for how errors are handled).

    Args:
        model: the unwrapped model (compile before DDP or ``fully_shard``: as torchtitan does).
        blocks: the blocks (:func:`find_blocks`); None compiles the whole model.
        name: the model's name in messages (``model.name``).
        fallback: ``model.compile_fallback``.
        announce: log the compile time (``compiled 2 block(s) in 3.1 s``) and a fallback: rank 0.

    Raises:
        UserError: ``torch.compile`` refused the module at once (an unsupported platform) and ``fallback``
            is false. Errors of the lazy compile are raised from the first forward.
    """
    targets = list(blocks) if blocks is not None else [model]
    what = f"{len(targets)} block(s)" if blocks is not None else "the whole model"
    handle = CompiledModel(what, targets, name, fallback, announce)
    try:
        for m in targets:
            m.compile()
            m._compiled_call_impl = _guard(handle, m, m._compiled_call_impl)
    except Exception as err:  # any refusal: Dynamo unsupported on this Python or platform
        if not fallback:
            raise _not_compiled(name, _first_line(err)) from None
        handle.to_eager(_first_line(err))
        return handle
    handle._waiting = {id(m) for m in targets}
    return handle


def speed_up(model: nn.Module, mc: Any, *, announce: bool = True) -> CompiledModel | None:
    """Apply the model section's speed settings (``mc``: the config's ``model``) to the unwrapped ``model``:
    activation checkpointing, then compile, on the same blocks; what was compiled (None: nothing).

    Call it between building the model and wrapping it in DDP or FSDP2.
    """
    blocks = check_blocks(model, mc)
    if mc.activation_checkpointing != "none":
        n = apply_activation_checkpointing(model, mc.activation_checkpointing, mc.ac_every, blocks=blocks)
        if announce:
            log.info("activation checkpointing (%s): %d of %d block(s)", mc.activation_checkpointing, n, len(blocks))
    if not mc.compile:
        return None
    return compile_model(model, blocks, name=mc.name, fallback=mc.compile_fallback, announce=announce)
