"""Shard attribution of a run's non-finite steps, and a verdict: look at the data first, or at the optimizer.

The evidence is the ledger (see :mod:`.ledger`): for each refused step, every rank's micro-batches
(shard and index of each example) and which examples had a non-finite *local* loss. The question is
whether those examples come from some shards far more often than chance allows.

The test. Over the refused steps whose non-finite losses were localized (some rank saw one) and in
which shard ``s`` was in play, let ``n_s`` be the non-finite example losses and ``k_s`` those from
shard ``s``; let ``q_s`` be shard ``s``'s share of all the examples *in play* in those same steps
(every rank's micro-batches). If the non-finite values had nothing to do with the data, each would
come from shard ``s`` with its step's share: ``k_s`` is a sum of binomials, whose upper tail the
binomial ``Binomial(n_s, q_s)`` of the same mean bounds (Hoeffding 1956), so that tail is the test.
Weighing each shard against the steps it was read in keeps several bad shards, each behind its own
spike, from diluting one another. A shard is a suspect when its upper tail ``P(X >= k_s)``,
Bonferroni-corrected over the shards tested, is below :data:`ALPHA`. Conditioning on what was in
play (rather than on the run's whole exposure) keeps a learning-rate blow-up late in training, which
turns every example of those steps non-finite, from incriminating whichever shards happened to be
read then. The verdict is ``shard-selective`` when the suspects are involved in at least half of the
refused steps, ``spread`` when there were refused steps otherwise, ``none`` without any. When no
rank saw a non-finite local loss (only the gradients were), every example in play counts and ``q_s``
is the shard's share of the run's exposure instead.

References:
    Bonferroni correction of multiple binomial tests; the seed's "suspect the data first" discipline.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadytrain._text import short
from steadytrain.accumulate import NonFiniteEvent
from steadytrain.data.sourcemap import read_sources
from steadytrain.diagnose.layers import attribution_sentence, read_layers, spike_layers
from steadytrain.diagnose.ledger import LEDGER, SPIKES, dataset_bounds, read_exposure, read_ledger
from steadytrain.diagnose.mixture import shard_name, source_keys, sources_phrase
from steadytrain.diagnose.stats import binomial_sf
from steadytrain.errors import UserError

if TYPE_CHECKING:
    from steadytrain.data.sourcemap import SourceMap

__all__ = ["ALPHA", "NonFiniteReport", "ShardStats", "report"]

ALPHA = 1e-3
"""Family-wise significance level of the shard test (Bonferroni over the shards tested)."""

_WORDS = {
    LEDGER: {"step": "non-finite step", "losses": "non-finite example losses", "command": "nan"},
    SPIKES: {"step": "loss spike", "losses": "outlying example losses", "command": "spikes"},
}
"""The same test over the two ledgers: a spike's flagged examples are its outliers (:func:`.ledger.outliers`)."""


@dataclass
class ShardStats:
    """One shard's share of the trouble: refused steps involving it, against examples seen from it."""

    shard: int
    events: int
    """Refused steps in which one of its examples had a non-finite loss (or, unlocalized, was in play)."""
    exposures: int | None
    """Examples seen from it over the run (all ranks); None when the run wrote no exposure yet."""
    rate: float | None
    """``events / exposures``."""
    nonfinite: int = 0
    """Non-finite example losses from it (``k_s``)."""
    expected: float = 0.0
    """``n * q_s``: what chance would give."""
    p_value: float = 1.0
    """``P(X >= k_s)`` under ``Binomial(n, q_s)``, uncorrected."""


@dataclass
class NonFiniteReport:
    """What :func:`report` found. ``to_dict`` has the contract keys ``verdict``, ``suspect_shards``,
    ``suspect_ranks``, ``suspect_hosts``, ``shards`` (``{shard, events, exposures, rate}``), ``ranks`` (refused
    steps in which the rank's own loss was non-finite) and ``sentence``. A mixture run's (``sources``) adds
    ``source`` and ``source_shard`` to each of ``shards`` and, after ``suspect_shards``, ``suspect_sources``
    (``{shard, source, source_shard}`` per suspect); the shard ids stay the mixture's."""

    verdict: str
    suspect_shards: list[int]
    shards: list[ShardStats]
    ranks: dict[int, int]
    sentence: str
    steps: list[int] = field(default_factory=list)
    """The refused optimizer steps."""
    localized: bool = True
    """Whether some rank saw a non-finite local loss (else only the gradients were non-finite)."""
    threshold: float = ALPHA
    suspect_ranks: list[int] = field(default_factory=list)
    """Ranks the trouble follows across shards (:mod:`.ranks`); empty unless ``rank-selective``."""
    suspect_hosts: list[str] = field(default_factory=list)
    """Their hosts, and any host the pooled test finds beyond chance."""
    layers: list[dict[str, Any]] | None = None
    """Spikes only: the layer each spike entered through (:func:`.layers.spike_layers`; empty without
    ``layers.jsonl``); None for non-finite steps."""
    sources: SourceMap | None = None
    """A mixture run's sources (``sources.json``): which source each shard id is in; None for one dataset."""

    def shard_name(self, shard: int) -> str:
        """``shard 7``, or a mixture run's ``web shard 3 (id 7)``."""
        return shard_name(self.sources, shard)

    def to_dict(self) -> dict[str, Any]:
        extra = {} if self.layers is None else {"layers": list(self.layers)}
        named = {}
        if self.sources is not None:
            named = {"suspect_sources": [{"shard": s, **source_keys(self.sources, s)} for s in self.suspect_shards]}
        return {
            "verdict": self.verdict,
            "suspect_shards": list(self.suspect_shards),
            **named,
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_hosts": list(self.suspect_hosts),
            "shards": [{**asdict(s), **source_keys(self.sources, s.shard)} for s in self.shards],
            "ranks": {str(r): n for r, n in sorted(self.ranks.items())},
            "sentence": self.sentence,
            "steps": list(self.steps),
            "localized": self.localized,
            "threshold": self.threshold,
            **extra,
        }


@dataclass
class _Step:
    in_play: Counter = field(default_factory=Counter)
    flagged: Counter = field(default_factory=Counter)
    bad_ranks: set[int] = field(default_factory=set)


def _flagged(event: NonFiniteEvent, tag: dict[str, Any], i: int) -> list[int]:
    """Shards of the examples of micro-batch ``i`` whose loss was non-finite on this rank."""
    if tag.get("nonfinite") is not None:
        return [tag["shard"][j] for j in tag["nonfinite"]]
    return list(tag["shard"]) if i in event.nonfinite_micro_batches else []


def _by_step(events: list[tuple[int, NonFiniteEvent]]) -> dict[tuple[int, int | None], _Step]:
    """Every rank's records of each step, keyed by ``(step, batch)``: after a spike's rollback the same step
    number trains on another batch (a second event)."""
    steps: dict[tuple[int, int | None], _Step] = {}
    for step, event in events:
        st = steps.setdefault((step, event.batch), _Step())
        for i, tag in enumerate(event.tags):
            st.in_play.update(tag["shard"])
            bad = _flagged(event, tag, i)
            st.flagged.update(bad)
            if bad or i in event.nonfinite_micro_batches:
                st.bad_ranks.add(event.rank)
    return steps


def _test(steps: dict[Any, _Step], exposure: dict[int, int] | None) -> tuple[Counter, Counter, bool]:
    """``(k per shard, n * q per shard as weights, localized)`` of the test described in the module docstring."""
    localized = any(st.flagged for st in steps.values())
    k, base = Counter(), Counter()
    for st in steps.values():
        if localized and not st.flagged:
            continue  # a step only the gradients saw: no local evidence to weigh
        k.update(st.flagged if localized else st.in_play)
        base.update(st.in_play)
    if not localized and exposure:
        base = Counter(exposure)
    return k, base, localized


def _shard_stats(steps: dict[Any, _Step], exposure: dict[int, int] | None) -> tuple[list[ShardStats], bool]:
    k, base, localized = _test(steps, exposure)
    n, total = sum(k.values()), sum(base.values())
    events = Counter()
    for st in steps.values():
        events.update(set(st.flagged) if st.flagged else set(st.in_play))
    out = []
    for s in sorted(set(events) | set(exposure or {}) | set(base)):
        n_s, q = (n, base[s] / total if total else 0.0) if not localized else _in_play_share(steps, s)
        seen = exposure.get(s, 0) if exposure is not None else None
        p = binomial_sf(min(k[s], n_s), n_s, min(q, 1.0)) if n_s else 1.0
        out.append(ShardStats(s, events[s], seen, events[s] / seen if seen else None, k[s], round(n_s * q, 3), p))
    out.sort(key=lambda st: (st.p_value, -st.events, st.shard))
    return out, localized


def _in_play_share(steps: dict[Any, _Step], shard: int) -> tuple[int, float]:
    """``(n_s, q_s)``: the flagged examples of the localized steps in which ``shard`` was in play, and its share of
    the examples in play in those steps (a shard read in one step is weighed against that step alone)."""
    n = in_play = total = 0
    for st in steps.values():
        if st.flagged and shard in st.in_play:
            n += sum(st.flagged.values())
            in_play += st.in_play[shard]
            total += sum(st.in_play.values())
    return n, in_play / total if total else 0.0


def _pct(part: int, whole: int) -> str:
    share = part / whole if whole else 0.0
    return f"{share:.1%}" if share >= 0.001 else f"{100 * share:.2g}%"


def _covered(steps: dict[Any, _Step], shards: set[int]) -> int:
    """Refused steps in which one of ``shards`` is implicated (flagged, or in play when nothing was)."""
    return sum(1 for st in steps.values() if set(st.flagged or st.in_play) & shards)


def _at(shard: int, sources: SourceMap | None) -> str:
    """``shard 7``; a mixture run's ``web shard 3, id 7`` (said inside parentheses)."""
    return f"shard {shard}" if sources is None else f"{sources.label(shard)}, id {shard}"


def _sentence(
    verdict: str,
    suspects: list[ShardStats],
    stats: list[ShardStats],
    steps: dict,
    exp: Any,
    words: dict[str, str],
    sources: SourceMap | None = None,
) -> str:
    nsteps = len(steps)
    if verdict == "none":
        return f"none: the ledger records no {words['step']}"
    if verdict == "spread" and not stats:  # a loop of your own that gave its micro-batches no example ids
        return (
            f"spread: {nsteps} {words['step']}(s), none attributable to a shard (the ledger names no examples: "
            "give run.micro_batch(ids) the example ids): look at the learning rate, clipping and precision first"
        )
    if verdict == "spread":
        best = stats[0] if stats else None
        tail = f"smallest tail p = {best.p_value:.2g} ({_at(best.shard, sources)})" if best else "no shard data"
        return (
            f"spread: {nsteps} {words['step']}(s) over {len({s.shard for s in stats if s.events})} shard(s), "
            f"no shard beyond chance ({tail}; threshold {ALPHA:g}/{max(len(stats), 1)} shards): "
            "look at the learning rate, clipping and precision first"
        )
    names = ("shard " if len(suspects) == 1 else "shards ") + ", ".join(str(s.shard) for s in suspects)
    if sources is not None:  # a mixture's: each in its source, and which sources they are in
        ids = [s.shard for s in suspects]
        names = f"{', '.join(shard_name(sources, i) for i in ids)}, {sources_phrase(sources, ids)}"
    involved = _covered(steps, {s.shard for s in suspects})
    seen = sum(s.exposures or 0 for s in suspects)
    share = f" ({_pct(seen, sum(exp.values()))} of examples seen)" if exp else " (exposure not recorded yet)"
    k = sum(s.nonfinite for s in suspects)
    expected = sum(s.expected for s in suspects)
    p = min(s.p_value for s in suspects)
    return (
        f"shard-selective: {involved} of {nsteps} {words['step']}s involve {names}{share}; "
        f"{k} {words['losses']} came from it where its share of the batches in play predicts {expected:.1f} "
        f"(binomial tail p = {p:.2g}, threshold {ALPHA:g}/{len(stats)} shards); inspect its data first "
        f"(steadytrain {words['command']} hunt RUN --shard {suspects[0].shard})"
    )


def report(run_dir: str | Path, ledger: str = LEDGER) -> NonFiniteReport:
    """Attribute a run's non-finite steps (or loss spikes) to shards and give a verdict (see the module docstring).

    Args:
        run_dir: a run directory written by ``steadytrain train`` (or any directory holding a
            ``nonfinite.jsonl`` ledger and, optionally, ``exposure.json``).
        ledger: :data:`~.ledger.LEDGER` (non-finite steps) or :data:`~.ledger.SPIKES` (loss spikes: the same
            test, a spike's outlying examples in place of the non-finite ones).

    Returns:
        The verdict (``shard-selective``, ``spread`` or ``none``), the suspects, per-shard numbers,
        per-rank local counts and one sentence with the numbers. For spikes, also the layer each spike entered
        through when the run wrote ``layers.jsonl`` (:func:`.layers.spike_layers`), said in the sentence too.

    Raises:
        UserError: no such directory, or a malformed ledger, exposure file or (spikes) ``layers.jsonl`` (a
            ledger's shard ids and example indices are checked against the run's dataset when ``data.json``
            names it and it is unchanged).

    Example:
        >>> import tempfile
        >>> report(tempfile.mkdtemp()).verdict
        'none'
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if ledger not in _WORDS:
        raise UserError(f"ledger={ledger!r}: use {LEDGER} or {SPIKES}")
    rep = _report(run_dir, ledger, read_sources(run_dir))
    if ledger == SPIKES:
        rep.layers = spike_layers(read_layers(run_dir), rep.steps)
        if said := attribution_sentence(rep.layers):
            rep.sentence = f"{rep.sentence}; {said}"
    return rep


def _report(run_dir: Path, ledger: str, sources: SourceMap | None) -> NonFiniteReport:
    """:func:`report`'s shard (or rank) attribution and verdict, before the layers (``sources``: a mixture run's)."""
    events = read_ledger(run_dir, ledger, bounds=dataset_bounds(run_dir))  # positions inside the run's data
    exposure = read_exposure(run_dir)
    steps = _by_step(events)
    ranks = {r: 0 for r in sorted({e.rank for _, e in events})}
    for st in steps.values():
        for r in st.bad_ranks:
            ranks[r] += 1
    stats, localized = _shard_stats(steps, exposure)
    cut = ALPHA / max(len(stats), 1)
    suspects = [s for s in stats if s.p_value < cut and s.nonfinite > s.expected]
    machines = _machines(run_dir, ledger, events, steps)
    if not steps:
        verdict = "none"
    elif machines is not None:
        rep = _rank_report(machines, stats, ranks, steps, localized, _WORDS[ledger])
        rep.sources = sources
        return rep
    elif suspects and _covered(steps, {s.shard for s in suspects}) * 2 >= len(steps):
        verdict = "shard-selective"
    else:
        verdict = "spread"
    suspects = suspects if verdict == "shard-selective" else []
    sentence = _sentence(verdict, suspects, stats, steps, exposure, _WORDS[ledger], sources)
    stats.sort(key=lambda st: (-st.events, st.shard))
    return NonFiniteReport(
        verdict, [s.shard for s in suspects], stats, ranks, sentence, sorted(s for s, _ in steps), localized, ALPHA,
        sources=sources,
    )  # fmt: skip


def _machines(run_dir: Path, ledger: str, events: list, steps: dict) -> tuple[list, list, list[str]] | None:
    """``(suspect rank stats, all rank stats, suspect hosts)`` when the verdict is ``rank-selective``, else None."""
    from steadytrain.diagnose import ranks as machine

    stats, _ = machine.rank_stats(events)
    found = machine.suspects(stats, ALPHA)
    if not found:
        return None
    bad = {s.rank for s in found}
    involved = {(step, e.batch) for step, e in events if e.rank in bad and machine.flagged_shards(e)}
    if len(involved) * 2 < len(steps):
        return None
    hosts = machine.suspect_hosts(events, machine.read_hosts(run_dir, ledger), sorted(bad), ALPHA)
    return found, stats, hosts


def _rank_report(machines, stats, ranks, steps, localized, words) -> NonFiniteReport:
    found, _, hosts = machines
    names = ", ".join(str(s.rank) for s in found)
    on = f" on {', '.join(map(short, hosts))}" if hosts else ""  # suspect_hosts has them whole
    k, expected, p = sum(s.flagged for s in found), sum(s.expected for s in found), min(s.p_value for s in found)
    sentence = (
        f"rank-selective: {sum(s.events for s in found)} of {len(steps)} {words['step']}s were flagged on rank(s) "
        f"{names}{on}, across {max(s.shards for s in found)} shards; {k} {words['losses']} there where its share of "
        f"the examples in play predicts {expected:.1f} (binomial tail p = {p:.2g}, threshold {ALPHA:g}/{len(ranks)} "
        "ranks): the trouble follows the machine, not the data: look at that rank's device and host first "
        "(memory errors, a faulty GPU)"
    )
    shards = sorted(stats, key=lambda st: (-st.events, st.shard))
    return NonFiniteReport(
        "rank-selective", [], shards, ranks, sentence, sorted(s for s, _ in steps), localized, ALPHA,
        suspect_ranks=sorted(int(s.rank) for s in found), suspect_hosts=hosts,
    )  # fmt: skip
