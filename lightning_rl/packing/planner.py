"""Row planning, for SFT and GRPO alike: split sequences into packed rows under a token budget, counted with
`PrefixCounter` (a row's tree grows one sequence at a time, never rebuilt).

- `plan_ordered_rows` keeps the sequences' order (SFT: a seeded epoch order, so a resumed run sees the same rows).
- `plan_rows` packs a batch first-fit decreasing and deals the rows to data-parallel ranks so that every rank gets
  the same number of rows and about the same attention work (GRPO).

Sequences of one group (the G completions of a prompt) stay in one row where they fit, so their shared prompt is
forwarded once. A group too large for one row is split into sub-groups that each keep the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_rl.packing.tree import PrefixCounter, count_unique_tokens, pack_sequences


@dataclass
class RowPlan:
    ranks: list[list[list[int]]]  # ranks[r][k] = indices of the sequences in row k of rank r
    unique_tokens: list[list[int]]  # the same layout: unique tokens per row
    attention_cost: list[float]  # per rank: (query, visible key) pairs over its rows
    num_flat_tokens: int
    num_unique_tokens: int

    @property
    def packing_ratio(self) -> float:
        return self.num_flat_tokens / max(self.num_unique_tokens, 1)


def attention_pairs(sequences: Sequence[Sequence[int]]) -> int:
    """(query, visible key) pairs of the packed tree: each unique token sees its depth + 1 keys."""
    batch = pack_sequences(sequences)
    return int((batch.position_ids[: batch.num_unique_tokens] + 1).sum())


def plan_rows(
    sequences: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    num_ranks: int = 1,
    groups: Sequence[int] | None = None,
) -> RowPlan:
    """Pack ``sequences`` into rows of at most ``max_tokens`` unique tokens, dealt to ``num_ranks`` ranks.

    Every rank gets the same number of rows (collectives such as FSDP all-gathers need every rank to run the
    same number of forwards); a rank with less work gets empty rows. Rows are dealt by attention cost, largest
    first, to the least-loaded rank that still has room.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    for i, s in enumerate(sequences):
        if len(s) > max_tokens:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than max_tokens={max_tokens}")
    group_of = list(groups) if groups is not None else list(range(len(sequences)))
    if len(group_of) != len(sequences):
        raise ValueError(f"{len(group_of)} group ids for {len(sequences)} sequences")

    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)

    # Units: a whole group, or the largest slices of it that fit in one row.
    units: list[list[int]] = []
    for idx in members.values():
        current, tree = [], PrefixCounter()
        for i in idx:
            if current and tree.size + tree.added_by(sequences[i]) > max_tokens:
                units.append(current)
                current, tree = [], PrefixCounter()
            current.append(i)
            tree.add(sequences[i])
        units.append(current)

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
    row_tokens = [tree.size for tree in trees]

    costs = [attention_pairs([sequences[j] for j in row]) for row in rows]
    per_rank = -(-len(rows) // num_ranks) if rows else 0
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    tokens: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0.0] * num_ranks
    for k in sorted(range(len(rows)), key=lambda k: costs[k], reverse=True):
        r = min((r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: load[r])
        ranks[r].append(sorted(rows[k]))
        tokens[r].append(row_tokens[k])
        load[r] += costs[k]
    for r in range(num_ranks):
        while len(ranks[r]) < per_rank:
            ranks[r].append([])
            tokens[r].append(0)
    return RowPlan(
        ranks=ranks,
        unique_tokens=tokens,
        attention_cost=load,
        num_flat_tokens=sum(len(s) for s in sequences),
        num_unique_tokens=sum(row_tokens),
    )


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
