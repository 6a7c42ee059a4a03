"""Row planning, for SFT and GRPO alike: split sequences into packed rows under a token budget, counted with
`PrefixCounter` (a row's tree grows one sequence at a time, never rebuilt).

- `plan_ordered_rows` keeps the sequences' order (SFT: a seeded epoch order, so a resumed run sees the same rows).
- `plan_rows` packs a batch first-fit decreasing and deals the rows to data-parallel ranks so that every rank gets
  the same number of rows and about the same attention work (GRPO).
- `plan_batch_rows` cuts one batch into rows of a smaller budget, sequences that share a first token a group (SFT's
  ``data.max_tokens_per_row``).

Sequences of one group (the G completions of a prompt) stay in one row where they fit, so their shared prompt is
forwarded once. A group too large for one row is either split into sub-groups that each keep the prompt, or (with
``prefix_across_rows``) cut into the prefix every sequence of the group shares, forwarded once on its own, and rows of
the rest (a *span*) that attend to that prefix's keys and values (`ops/prefix_rows.py`). A span's rows go to one rank,
one after the other. Spans nest: within a span, a deeper shared part whose subtree does not fit in one row either (a
first turn and its answers) becomes a span of its own below it, its prefix forwarded once after its parent's, where
that forwards fewer tokens than cutting the subtree into rows that each repeat it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_rl.packing.tree import PrefixCounter, common_prefix, count_unique_tokens, pack_sequences


PrefixAcrossRows = Literal["auto", "always", "never"]
# A span row's prefix: (span, prefix length), or for a nested span the chain of them from the outermost.
RowPrefix = tuple[int, int] | tuple[tuple[int, int], ...]
# What forwarding a prefix on its own costs beyond its tokens (one more forward and backward, its keys and values
# joined in front of every row's), in tokens: an estimate that makes ``auto`` keep sub-groups where little is saved.
PREFIX_OVERHEAD_TOKENS = 64


@dataclass
class RowPlan:
    ranks: list[list[list[int]]]  # ranks[r][k] = indices of the sequences in row k of rank r
    unique_tokens: list[list[int]]  # the same layout: unique tokens per row (a span's rows: the prefix excluded)
    attention_cost: list[float]  # per rank: (query, visible key) pairs over its rows
    num_flat_tokens: int
    num_unique_tokens: int
    # The same layout: (span, prefix length) for a row of a span, None for a row of its own. A span's rows are
    # consecutive on one rank; every row of span s drops the same first prefix-length tokens of its sequences. A row
    # of a nested span: its chain of (span, prefix length), outermost first, the lengths counted from the sequences'
    # start (`RowPrefix`).
    prefixes: list[list[RowPrefix | None]] = field(default_factory=list)

    @property
    def packing_ratio(self) -> float:
        return self.num_flat_tokens / max(self.num_unique_tokens, 1)


def attention_pairs(sequences: Sequence[Sequence[int]]) -> int:
    """(query, visible key) pairs of the packed tree: each unique token sees its depth + 1 keys."""
    batch = pack_sequences(sequences)
    return int((batch.position_ids[: batch.num_unique_tokens] + 1).sum())


class RowTooLong(ValueError):
    """A sequence longer than a row, which no prefix forwarded apart leaves within one (``length``: its tokens)."""

    def __init__(self, message: str, length: int) -> None:
        super().__init__(message)
        self.length = length


def plan_rows(
    sequences: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    num_ranks: int = 1,
    groups: Sequence[int] | None = None,
    prefix_across_rows: PrefixAcrossRows = "never",
    prefix_limits: Sequence[int] | None = None,
) -> RowPlan:
    """Pack ``sequences`` into rows of at most ``max_tokens`` unique tokens, dealt to ``num_ranks`` ranks.

    Every rank gets the same number of rows (collectives such as FSDP all-gathers need every rank to run the
    same number of forwards); a rank with less work gets empty rows. Rows are dealt by attention cost, largest
    first, to the least-loaded rank that still has room (a span's rows together).

    ``prefix_across_rows``: for a group too large for one row, ``always`` forwards the prefix its sequences share
    once (a span), ``never`` splits it into sub-groups, ``auto`` takes the span where it saves more tokens than
    `PREFIX_OVERHEAD_TOKENS`. ``prefix_limits[i]``: the most leading tokens of sequence ``i`` a prefix may take
    (none of them may be the input of a loss term, since the prefix's forward produces no outputs); default: all
    but its last. A sequence longer than ``max_tokens`` is refused unless its group's span leaves it within.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if prefix_across_rows not in ("auto", "always", "never"):
        raise ValueError(f"prefix_across_rows must be auto, always or never, got {prefix_across_rows!r}")
    group_of = list(groups) if groups is not None else list(range(len(sequences)))
    if len(group_of) != len(sequences):
        raise ValueError(f"{len(group_of)} group ids for {len(sequences)} sequences")
    limits = list(prefix_limits) if prefix_limits is not None else [len(s) - 1 for s in sequences]
    if len(limits) != len(sequences):
        raise ValueError(f"{len(limits)} prefix limits for {len(sequences)} sequences")

    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)

    # Units: a whole group, or the largest slices of it that fit in one row; spans: a group's shared prefix and rows.
    units: list[list[int]] = []
    spans: list[_Span] = []
    for idx in members.values():
        seqs = [sequences[i] for i in idx]
        span = None
        if prefix_across_rows != "never" and count_unique_tokens(seqs) > max_tokens:
            span = _span(sequences, idx, limits, max_tokens)
        subgroups = _slices(seqs, max_tokens) if all(len(s) <= max_tokens for s in seqs) else None
        if span is not None and (subgroups is None or prefix_across_rows == "always" or _saves(span, subgroups, seqs)):
            spans.append(span)
            continue
        if subgroups is None:
            i = next(i for i in idx if len(sequences[i]) > max_tokens)
            raise RowTooLong(f"sequence {i} has {len(sequences[i])} tokens, more than max_tokens={max_tokens}", len(sequences[i]))
        units += [[idx[j] for j in unit] for unit in subgroups]

    # First-fit decreasing on unique tokens; a unit joining a row costs what it adds to the row's tree.
    sized = sorted(units, key=lambda u: count_unique_tokens([sequences[j] for j in u]), reverse=True)
    rows: list[list[int]] = []
    trees: list[PrefixCounter] = []
    for unit in sized:
        seqs = [sequences[j] for j in unit]
        k = next((k for k, tree in enumerate(trees) if tree.size + tree.added_by_all(seqs) <= max_tokens), len(rows))
        if k == len(rows):
            rows.append([])
            trees.append(PrefixCounter())
        rows[k] += unit
        for seq in seqs:
            trees[k].add(seq)

    # Dealing units: a row of its own, or a span's rows (kept together on one rank, in order).
    dealt = [([row], [tree.size], [None]) for row, tree in zip(rows, trees)]
    ids = iter(range(1 << 62))  # span ids, nested ones included
    dealt += [span.flat(ids) for span in spans]
    costs = [sum(attention_pairs([sequences[j] for j in row]) for row in unit[0]) for unit in dealt]
    per_rank = -(-sum(len(unit[0]) for unit in dealt) // num_ranks)
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    tokens: list[list[int]] = [[] for _ in range(num_ranks)]
    prefixes: list[list[tuple[int, int] | None]] = [[] for _ in range(num_ranks)]
    load = [0.0] * num_ranks
    for k in sorted(range(len(dealt)), key=lambda k: costs[k], reverse=True):
        unit_rows, unit_tokens, unit_prefixes = dealt[k]
        room = [r for r in range(num_ranks) if len(ranks[r]) + len(unit_rows) <= per_rank] or list(range(num_ranks))
        r = min(room, key=lambda r: load[r])
        ranks[r] += [sorted(row) for row in unit_rows]
        tokens[r] += unit_tokens
        prefixes[r] += unit_prefixes
        load[r] += costs[k]
    most = max((len(rank) for rank in ranks), default=0)
    for r in range(num_ranks):
        while len(ranks[r]) < most:
            ranks[r].append([])
            tokens[r].append(0)
            prefixes[r].append(None)
    return RowPlan(
        ranks=ranks,
        unique_tokens=tokens,
        attention_cost=load,
        num_flat_tokens=sum(len(s) for s in sequences),
        num_unique_tokens=sum(tree.size for tree in trees) + sum(span.forwarded for span in spans),
        prefixes=prefixes,
    )


def _slices(seqs: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` in order, cut into the largest runs whose tree fits in ``max_tokens``."""
    units: list[list[int]] = []
    current, tree = [], PrefixCounter()
    for i, seq in enumerate(seqs):
        if current and tree.size + tree.added_by(seq) > max_tokens:
            units.append(current)
            current, tree = [], PrefixCounter()
        current.append(i)
        tree.add(seq)
    units.append(current)
    return units


@dataclass
class _Span:
    """A span: the prefix its sequences share (``length`` tokens from their start, of which ``base`` are its parent
    span's), rows of what follows it for the sequences in no nested span (``tokens``: unique tokens per row), and
    its nested spans."""

    base: int
    length: int
    rows: list[list[int]]
    tokens: list[int]
    children: list[_Span]

    @property
    def forwarded(self) -> int:
        """Tokens forwarded for it: its own prefix, its rows and its nested spans."""
        return self.length - self.base + sum(self.tokens) + sum(child.forwarded for child in self.children)

    def flat(self, ids: Iterator[int], chain: tuple[tuple[int, int], ...] = ()) -> tuple[list[list[int]], list[int], list[RowPrefix]]:
        """Its rows and its nested spans' (each span's together, in order), their unique tokens and `RowPrefix`es."""
        chain = (*chain, (next(ids), self.length))
        rows, tokens = list(self.rows), list(self.tokens)
        prefixes: list[RowPrefix] = [chain[0] if len(chain) == 1 else chain] * len(rows)
        for child in self.children:
            child_rows, child_tokens, child_prefixes = child.flat(ids, chain)
            rows, tokens, prefixes = rows + child_rows, tokens + child_tokens, prefixes + child_prefixes
        return rows, tokens, prefixes


def _balanced(seqs: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """`_slices` into as few rows, as even as they go: the least budget that needs no more rows than
    ``max_tokens`` does (a span's largest row sets its peak memory; the rows' tokens are about the same)."""
    rows = _slices(seqs, max_tokens)
    low, high = 1, max_tokens  # the least budget giving len(rows) rows lies in (low - 1, high]
    while low < high:
        middle = (low + high) // 2
        if max(map(len, seqs)) <= middle and len(_slices(seqs, middle)) <= len(rows):
            high = middle
        else:
            low = middle + 1
    return _slices(seqs, high)


def _span(sequences: Sequence[Sequence[int]], idx: Sequence[int], limits: Sequence[int], max_tokens: int, base: int = 0) -> _Span | None:
    """The prefix the sequences ``idx`` share beyond ``base`` tokens (within ``limits``), and rows of what follows
    it, each within ``max_tokens``; a subtree of those rests too large for one row becomes a nested span where that
    forwards fewer tokens. None when they share nothing more or a rest does not fit."""
    seqs = [sequences[i] for i in idx]
    length = min(min(limits[i] for i in idx), *(len(s) - 1 for s in seqs))  # every rest keeps a token
    for s in seqs[1:]:
        length = min(length, common_prefix(seqs[0], s))
    if length <= base:
        return None
    rest = {i: sequences[i][length:] for i in idx}
    # By the first token after the prefix: the subtrees below it. A sequence whose limit stops it at this prefix (it
    # trains from the next token) goes in no nested prefix: it is kept apart, so the others' may go deeper.
    parts: dict[tuple[int, bool], list[int]] = {}
    for i in idx:
        parts.setdefault((rest[i][0], limits[i] > length), []).append(i)
    plain, children = [], []
    for part in parts.values():
        child = None
        if len(part) > 1 and count_unique_tokens([rest[i] for i in part]) > max_tokens:
            child = _span(sequences, part, limits, max_tokens, base=length)
        if child is not None and all(len(rest[i]) <= max_tokens for i in part):
            repeated = sum(count_unique_tokens([rest[part[j]] for j in row]) for row in _slices([rest[i] for i in part], max_tokens))
            child = child if child.forwarded + PREFIX_OVERHEAD_TOKENS < repeated else None
        if child is None:
            plain += part
        else:
            children.append(child)
    if any(len(rest[i]) > max_tokens for i in plain):
        return None
    rows = [[plain[j] for j in row] for row in _balanced([rest[i] for i in plain], max_tokens)] if plain else []
    return _Span(base, length, rows, [count_unique_tokens([rest[i] for i in row]) for row in rows], children)


def _saves(span: _Span, subgroups: list[list[int]], seqs: Sequence[Sequence[int]]) -> bool:
    """Whether the span forwards fewer tokens than the sub-groups, by more than the prefix's own forward costs."""
    return span.forwarded + PREFIX_OVERHEAD_TOKENS < sum(count_unique_tokens([seqs[j] for j in unit]) for unit in subgroups)


def prefix_limits(loss_masks: Sequence[Sequence[bool]], sequences: Sequence[Sequence[int]] | None = None, image_token_id: int | None = None) -> list[int]:
    """Per sequence, the most leading tokens a prefix forwarded apart may take: none that is the input of a trained
    token (the prefix's forward produces no outputs), and never the whole sequence; with ``sequences``, never part of
    an image's placeholders (a run of ``image_token_id``, or of the negative ids that key images apart): the prefix
    then stops before the image, which its rows encode."""
    placeholder = lambda t: t < 0 or t == image_token_id  # noqa: E731
    limits = []
    for k, mask in enumerate(loss_masks):
        trained = [t for t, on in enumerate(mask) if on and t > 0]
        limit = trained[0] - 1 if trained else len(mask) - 1
        while sequences is not None and 0 < limit < len(sequences[k]) and placeholder(sequences[k][limit - 1]) and placeholder(sequences[k][limit]):
            limit -= 1
        limits.append(limit)
    return limits


def plan_batch_rows(
    sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]], max_tokens: int, prefix_across_rows: PrefixAcrossRows
) -> tuple[list[list[int]], list[RowPrefix | None]]:
    """One batch's sequences cut into rows of at most ``max_tokens`` unique tokens, and each row's span prefix
    (`RowPlan.prefixes`): sequences that start with the same token are a group (`plan_rows`; sequences that do not
    share nothing), whose shared prefix, up to its first trained token's input, may be forwarded once for its rows."""
    firsts: dict[int, int] = {}
    groups = [firsts.setdefault(seq[0], len(firsts)) for seq in sequences]
    plan = plan_rows(sequences, max_tokens, groups=groups, prefix_across_rows=prefix_across_rows, prefix_limits=prefix_limits(loss_masks, sequences))
    return plan.ranks[0], plan.prefixes[0]


def plan_ordered_rows(sequences: Sequence[Sequence[int]], max_tokens: int, packing: Literal["tree", "flat", "none"]) -> list[list[int]]:
    """Indices of ``sequences``, in their order, grouped into rows of at most ``max_tokens`` forwarded tokens: under
    ``tree`` packing a row counts unique tokens (shared prefixes once), under ``flat`` every token; ``none`` puts
    one sequence in each row. A sequence longer than the budget gets a row of its own."""
    if packing == "none":
        return [[i] for i in range(len(sequences))]
    rows: list[list[int]] = []
    current: list[int] = []
    tree, used = PrefixCounter(), 0
    for i, seq in enumerate(sequences):
        cost = tree.added_by(seq) if packing == "tree" else len(seq)
        if current and used + cost > max_tokens:
            rows.append(current)
            current, tree, used = [], PrefixCounter(), 0
            cost = len(seq)
        current.append(i)
        used += cost
        if packing == "tree":
            tree.add(seq)
    if current:
        rows.append(current)
    return rows
