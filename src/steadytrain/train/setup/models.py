"""Models for ``steadytrain train``: the built-ins and ``package.module:factory`` from the user.

The contract every model follows: ``forward(batch)`` takes a micro-batch dict (columns as tensors
or lists, plus ``shard`` and ``index``) and returns the per-example losses (a 1-D tensor, one per
example; steadytrain takes the mean and knows which examples were non-finite) or a scalar mean.

- ``tiny-lm``: a byte-level transformer (token and position embeddings, pre-norm blocks, causal
  attention); the batch holds ``tokens`` (int, ``[B, seq_len + 1]``), the loss is next-byte
  cross-entropy averaged per sequence.
- ``hf:<model_type>`` / ``hf:<directory>``: a ``transformers`` causal LM (:mod:`steadytrain.train.hf.model`).
- ``tabular``: an embedding per categorical field of the schema and an MLP over its numeric fields
  standardized with the dataset's statistics; the loss is cross-entropy on an integer label column
  (or MSE on a float one). With ``oov="error"`` (default) a categorical value outside the vocabulary
  maps to index ``-1``, which the embedding lookup refuses: out-of-vocabulary data fails loudly instead
  of reading a wrong row. ``oov="bucket"`` maps every such value to one extra row (the usual feature
  pipeline's out-of-vocabulary bucket). ``target_encoding=True`` adds, per categorical field, the
  label's mean (per class, for a classification label) among the examples of that category, fitted on
  the data the vocabulary came from; ``target_smoothing`` blends it with the overall mean. Unsmoothed,
  the out-of-vocabulary bucket has a count of zero and its encoding is 0/0: a value the vocabulary
  never saw becomes NaN (the shard-47 scenario of ``steadytrain demo nan``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadytrain._check import check_finite, check_int
from steadytrain._imports import import_callable
from steadytrain._io import brief
from steadytrain._text import error_text
from steadytrain.errors import UserError
from steadytrain.train.hf.model import build_hf, is_hf

__all__ = ["Attention", "Block", "TabularModel", "TargetEncoding", "TinyLM", "build_model", "check_losses"]


class Attention(nn.Module):
    """Causal multi-head self-attention with separate query, key, value and output projections, so a tensor-parallel
    plan can split the heads (query/key/value column-wise, output row-wise): the heads are counted from the
    projection's output, whatever share of them this rank holds."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A small language model: bytes (256 symbols) by default, or the vocabulary of an ingested dataset."""

    def __init__(
        self, *, dim: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 128, vocab_size: int = 256
    ) -> None:
        super().__init__()
        check_int("model.dim", dim, maximum=1 << 16)
        check_int("model.layers", layers, minimum=0, maximum=1024)
        check_int("model.heads", heads, maximum=1024)
        check_int("model.seq_len", seq_len, maximum=1 << 20)
        check_int("model.vocab_size", vocab_size, maximum=1 << 24)
        if dim % heads:
            raise UserError(f"model.dim={dim} must be divisible by model.heads={heads}")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        tokens = batch["tokens"].long()
        x_in, target = tokens[:, :-1], tokens[:, 1:]
        t = x_in.shape[1]
        if t > self.seq_len:
            raise UserError(f"sequences of {t} bytes are longer than model.seq_len={self.seq_len}")
        x = self.tok(x_in) + self.pos(torch.arange(t, device=x_in.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [B, T]
        return loss.mean(dim=1)  # one loss per sequence

    def tp_plan(self, mesh: Any) -> dict[str, Any]:
        """The tensor-parallel plan (``parallelize_module``'s): in every block the attention's query, key and value
        column-wise (each rank holds ``heads / tp`` heads) and its output row-wise, the MLP's first linear
        column-wise and its second row-wise (one all-reduce after each); embeddings, norms and the head replicated."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        tp = mesh.size()
        if not len(self.blocks):
            raise UserError(f"model.layers=0: no layers to split over distributed.mesh.tp={tp}: give layers, or tp=1")
        heads = self.blocks[0].attn.heads
        if heads % tp:
            raise UserError(
                f"model.heads={heads} does not split over distributed.mesh.tp={tp}: give model.heads a multiple of "
                f"{tp}, or a tp that divides {heads}"
            )
        plan: dict[str, Any] = {}
        for i in range(len(self.blocks)):
            for name in ("q", "k", "v"):
                plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
            plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
            plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
            plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
        return plan


class TargetEncoding(nn.Module):
    """Per category, the label's mean among that category's examples: ``sums[c] / counts[c]``.

    ``sums`` is ``[categories, width]`` (one column per class for a classification label), ``counts``
    ``[categories]``. With ``smoothing = m > 0`` the encoding is ``(sums + m * prior) / (counts + m)``;
    with ``m = 0`` a category with no examples (the out-of-vocabulary bucket) encodes as 0/0 = NaN.
    """

    def __init__(self, sums: Tensor, counts: Tensor, smoothing: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("sums", sums.float())
        self.register_buffer("counts", counts.float())
        self.smoothing = float(smoothing)
        total = counts.sum().clamp(min=1)
        self.register_buffer("prior", sums.float().sum(0) / total)

    def forward(self, idx: Tensor) -> Tensor:
        m = self.smoothing
        return (self.sums[idx] + m * self.prior) / (self.counts[idx] + m).unsqueeze(1)


class TabularModel(nn.Module):
    """Embeddings of categorical fields + an MLP over standardized numeric fields (see the module docstring)."""

    def __init__(
        self,
        *,
        numeric: dict[str, tuple[float, float]],
        categorical: dict[str, list[Any]],
        label: str,
        num_classes: int | None,
        hidden: int = 64,
        embed_dim: int = 8,
        oov: str = "error",
        target_stats: dict[str, tuple[Tensor, Tensor]] | None = None,
        target_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        check_int("model.hidden", hidden, maximum=1 << 20)
        check_int("model.embed_dim", embed_dim, maximum=1 << 16)
        check_finite("model.target_smoothing", target_smoothing, minimum=0.0)
        if oov not in ("error", "bucket"):
            raise UserError(f"model.oov={brief(oov)}: use error (refuse unknown categories) or bucket")
        self.numeric, self.label, self.num_classes, self.oov = list(numeric), label, num_classes, oov
        self.register_buffer("mean", torch.tensor([m for m, _ in numeric.values()], dtype=torch.float32))
        self.register_buffer("std", torch.tensor([s for _, s in numeric.values()], dtype=torch.float32))
        self.vocab = {name: {v: i for i, v in enumerate(values)} for name, values in categorical.items()}
        rows = {name: len(v) + (oov == "bucket") for name, v in categorical.items()}
        self.embed = nn.ModuleDict({name: nn.Embedding(n, embed_dim) for name, n in rows.items()})
        self.target = nn.ModuleDict(
            {name: TargetEncoding(*target_stats[name], target_smoothing) for name in categorical}
            if target_stats is not None
            else {}
        )
        width = len(self.numeric) + embed_dim * len(self.embed)
        width += sum(int(enc.sums.shape[1]) for enc in self.target.values())
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, num_classes or 1))

    def _indices(self, name: str, values: list[Any], device: torch.device) -> Tensor:
        vocab = self.vocab[name]
        missing = len(vocab) if self.oov == "bucket" else -1
        return torch.tensor([vocab.get(v, missing) for v in values], dtype=torch.long, device=device)

    def forward(self, batch: dict[str, Any]) -> Tensor:
        parts = []
        if self.numeric:
            x = torch.stack([batch[n].float() for n in self.numeric], dim=1)
            parts.append((x - self.mean) / self.std)
        for name, emb in self.embed.items():
            idx = self._indices(name, batch[name], self.mean.device)
            parts.append(emb(idx))
            if name in self.target:
                parts.append(self.target[name](idx))
        out = self.mlp(torch.cat(parts, dim=1))
        y = batch[self.label]
        if self.num_classes:
            return F.cross_entropy(out, y.long(), reduction="none")
        return (out.squeeze(1) - y.float()).pow(2)


def _import_factory(spec: str):
    return import_callable(spec, "model.name", "use tiny-lm, tabular or package.module:factory")


def tabular_from_dataset(
    schema: Any,
    stats: dict[str, tuple[float, float]],
    label: str,
    target_encoding: bool = False,
    category_counts: Any = None,
    **kwargs: Any,
) -> TabularModel:
    """A :class:`TabularModel` for a schema: categorical fields embedded, numeric ones standardized.

    ``category_counts(categorical, label, num_classes, oov_bucket)`` gives ``{field: (sums, counts)}``
    for ``target_encoding`` (fitted on the shards the vocabulary came from).
    """
    if label not in schema.fields:
        raise UserError(f"model.label={label!r} is not a field of the schema ({', '.join(schema.fields)})")
    numeric = {n: stats[n] for n, f in schema.fields.items() if n != label and f.vocabulary is None and n in stats}
    categorical = {n: list(f.vocabulary) for n, f in schema.fields.items() if n != label and f.vocabulary is not None}
    spec = schema.fields[label]
    is_int = spec.dtype.startswith(("int", "uint"))
    num_classes = int(spec.max) + 1 if is_int and spec.max is not None and math.isfinite(spec.max) else None
    if target_encoding:
        if category_counts is None:
            raise UserError("model.target_encoding needs the dataset's category statistics (built-in data only)")
        bucket = kwargs.get("oov", "error") == "bucket"
        kwargs["target_stats"] = category_counts(categorical, label, num_classes, bucket)
    return TabularModel(numeric=numeric, categorical=categorical, label=label, num_classes=num_classes, **kwargs)


def check_losses(out: Any, n: int) -> Tensor:
    """``out`` if it keeps the model contract for a batch of ``n`` examples: per-example losses ``[n]`` or a
    scalar mean; a UserError saying what the model returned otherwise (in training and evaluation alike)."""
    if not isinstance(out, Tensor) or out.dim() > 1 or (out.dim() == 1 and len(out) != n):
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise UserError(f"model returned {shape}: return per-example losses (shape [{n}]) or a scalar mean")
    return out


def _check_fits(data: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Refuse a tiny-lm smaller than its data: token ids past ``model.vocab_size`` (or windows longer than
    ``model.seq_len``) would fail inside the first forward, as an index error."""
    for key in ("vocab_size", "seq_len"):
        if key in kwargs and key in data and isinstance(kwargs[key], int) and kwargs[key] < data[key]:
            raise UserError(
                f"model.{key}={kwargs[key]} is smaller than the dataset's {key} ({data[key]}, in its index.json "
                f"provenance): remove model.{key} or set it to at least {data[key]}"
            )


def build_model(name: str, kwargs: dict[str, Any], *, context: dict[str, Any]) -> nn.Module:
    """The model ``name`` with ``kwargs``; built-ins also get what they need from ``context``
    (``seq_len`` and ``vocab_size`` for tiny-lm; ``schema`` and ``stats`` for tabular)."""
    try:
        if name == "tiny-lm":
            given = {k: context[k] for k in ("seq_len", "vocab_size") if k in context}
            _check_fits(given, kwargs)
            return TinyLM(**{**given, **kwargs})
        if is_hf(name):
            return build_hf(name, kwargs, context)
        if name == "tabular":
            return tabular_from_dataset(
                context["schema"],
                context["stats"],
                category_counts=context.get("category_counts"),
                **{"label": "label", **kwargs},
            )
        factory = _import_factory(name)
    except TypeError as err:
        raise UserError(f"model {name!r}: {error_text(err)} (check the model section's keys)") from None
    try:
        model = factory(**kwargs)
    except UserError:
        raise
    except Exception as err:  # the user's factory refused its arguments (or failed): name it and the keys
        keys = ", ".join(f"{k}={brief(v)}" for k, v in kwargs.items()) or "no keyword arguments"
        raise UserError(
            f"model.name={name!r}: the factory raised {type(err).__name__}: {error_text(err)} (called with {keys})"
        ) from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model.name={name!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model
