"""Prefix-tree packing: pure tensors in, pure tensors out (no Lightning, no models).

Sequences that share a prefix are laid out as a trie in depth-first order, so every shared token is stored
(and later forwarded) once. Sorting the sequences lexicographically *is* a depth-first walk of their trie:
sequence k only adds the tokens past its longest common prefix with sequence k-1, and the subtree of every
token is a contiguous interval of the layout. That gives the compact ancestor relation used everywhere:

    key j is visible to query i   iff   j <= i < subtree_end[j]

The layout is cut into *segments*: chains of tokens whose parent is the previous token. A segment's tokens all
have the same ancestors outside the segment (the tokens of its ancestor segments), which is what tree attention
exploits. With ``share_prefixes=False`` every sequence is its own root and the same code yields ordinary
padding-free packing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class PackedBatch:
    """One packed row: the unique tokens of a set of sequences and the loss terms that read them."""

    input_ids: Tensor  # [N] unique tokens, depth-first order (trailing padding included)
    position_ids: Tensor  # [N] depth of each token along its own path
    subtree_end: Tensor  # [N] key j is visible to query i iff j <= i < subtree_end[j]
    segments: Tensor  # [S, 3] (start, end, subtree_end) of each chain segment
    loss_positions: Tensor  # [M] packed index whose output predicts the target
    loss_targets: Tensor  # [M] target token ids
    loss_seq: Tensor  # [M] index of the sequence (in the input list) each term belongs to
    token_values: dict[str, Tensor] = field(default_factory=dict)  # each [M]
    seq_values: dict[str, Tensor] = field(default_factory=dict)  # each [B]
    num_sequences: int = 0
    num_flat_tokens: int = 0  # what flat packing would forward: the sum of sequence lengths
    num_unique_tokens: int = 0  # real tokens forwarded here (padding excluded)
    pad_to_multiple_of: int | None = None  # the row's length is a multiple of this (static-shape devices)
    # Models with multi-axis rotary positions (images in Qwen-VL style): [A, N], each token's along its own path.
    rope_position_ids: Tensor | None = None
    # Image inputs of the row's image placeholders, in row order: the keyword arguments of the model's
    # ``get_image_features``; each image of a shared prefix is in the row, and so here, once.
    image_inputs: dict[str, Tensor] = field(default_factory=dict)
    # [N, layers, top_k] the experts the engine routed each token to (router replay), -1 where it routed none.
    routes: Tensor | None = None
    # [M, K] per loss term, the token ids its sampler could draw (the sampling filters' support), -1 as padding; a row
    # of -1 only, or None for the whole row, scores the full distribution. It travels with its term as token_values do.
    token_support: Tensor | None = None
    # A row of one sequence (``data.packing: none``) that the model runs exactly as it runs that sequence alone: its
    # own attention and positions, no tree (so a model tree attention cannot drive trains too).
    unpacked: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def packing_ratio(self) -> float:
        return self.num_flat_tokens / max(self.num_unique_tokens, 1)

    def to(self, device: torch.device | str) -> PackedBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedBatch(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            subtree_end=move(self.subtree_end),
            segments=self.segments,  # read on the host to slice, never on the device
            loss_positions=move(self.loss_positions),
            loss_targets=move(self.loss_targets),
            loss_seq=move(self.loss_seq),
            token_values={k: move(v) for k, v in self.token_values.items()},
            seq_values={k: move(v) for k, v in self.seq_values.items()},
            num_sequences=self.num_sequences,
            num_flat_tokens=self.num_flat_tokens,
            num_unique_tokens=self.num_unique_tokens,
            pad_to_multiple_of=self.pad_to_multiple_of,
            rope_position_ids=None if self.rope_position_ids is None else move(self.rope_position_ids),
            image_inputs={k: move(v) for k, v in self.image_inputs.items()},
            routes=None if self.routes is None else move(self.routes),
            token_support=None if self.token_support is None else move(self.token_support),
            unpacked=self.unpacked,
        )

    def visibility_mask(self) -> Tensor:
        """Dense [N, N] boolean mask of the ancestor relation. For tests and references only: O(N^2)."""
        i = torch.arange(self.num_tokens)
        return (i[None, :] <= i[:, None]) & (i[:, None] < self.subtree_end[None, :])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = torch.nonzero(torch.as_tensor(a[:n]) != torch.as_tensor(b[:n]))
    return int(diff[0]) if diff.numel() else n


def _validate(sequences: Sequence[Sequence[int]], loss_masks, token_values, seq_values, token_supports) -> None:
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        if loss_masks is not None and len(loss_masks[i]) != len(seq):
            raise ValueError(f"sequence {i}: loss mask has {len(loss_masks[i])} entries for {len(seq)} tokens")
        for name, values in (token_values or {}).items():
            if len(values[i]) != len(seq):
                raise ValueError(f"sequence {i}: token value {name!r} has {len(values[i])} entries for {len(seq)} tokens")
    if token_supports is not None:
        if len(token_supports) != len(sequences):
            raise ValueError(f"{len(token_supports)} token supports for {len(sequences)} sequences")
        for i, (seq, support) in enumerate(zip(sequences, token_supports)):
            if support is not None and (support.dim() != 2 or support.shape[0] != len(seq)):
                raise ValueError(f"sequence {i}: token support of shape {tuple(support.shape)} for {len(seq)} tokens (want [tokens, K])")
    if loss_masks is not None and len(loss_masks) != len(sequences):
        raise ValueError(f"{len(loss_masks)} loss masks for {len(sequences)} sequences")
    for name, values in (seq_values or {}).items():
        if len(values) != len(sequences):
            raise ValueError(f"sequence value {name!r} has {len(values)} entries for {len(sequences)} sequences")


def pack_sequences(
    sequences: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[bool]] | None = None,
    *,
    token_values: Mapping[str, Sequence[Sequence[float]]] | None = None,
    seq_values: Mapping[str, Sequence[float]] | None = None,
    share_prefixes: bool = True,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    rope_positions: Sequence[Tensor] | None = None,
    routes: Sequence[Tensor] | None = None,
    token_supports: Sequence[Tensor | None] | None = None,
) -> PackedBatch:
    """Pack ``sequences`` into one row as a prefix tree.

    ``loss_masks[i][t]`` marks token ``t`` of sequence ``i`` as trained (predicted from token ``t-1``; token 0 is
    never trained). Without masks every token but the first is trained. ``token_values[name][i][t]`` is carried
    for each trained token, ``seq_values[name][i]`` per sequence. ``rope_positions[i]`` ([A, len]) are sequence
    ``i``'s multi-axis positions; a token shared by several sequences must have the same ones in each (they depend
    only on its path), or the sequences are refused. ``token_supports[i]`` ([len, K_i] token ids, -1 as padding, or
    None) is sequence ``i``'s per-token sampling support, carried for each trained token as ``token_values`` are.
    """
    _validate(sequences, loss_masks, token_values, seq_values, token_supports)
    seqs = [list(map(int, s)) for s in sequences]
    # Roots are keyed by sequence index when prefixes must not be shared, so no two sequences meet.
    keyed = [((0 if share_prefixes else i), s) for i, s in enumerate(seqs)]
    order = sorted(range(len(seqs)), key=lambda i: keyed[i])

    paths: list[Tensor] = [torch.empty(0, dtype=torch.long)] * len(seqs)  # packed index of each token, per sequence
    chunks: list[Tensor] = []
    starts: list[int] = []  # segment starts
    prev: int | None = None
    n = 0
    for i in order:
        seq = seqs[i]
        shared = 0
        if prev is not None and keyed[prev][0] == keyed[i][0]:
            shared = common_prefix(seqs[prev], seq)
            prev_len = len(seqs[prev])
            if 0 < shared < prev_len:
                starts.append(int(paths[prev][shared]))  # the earlier branch now forks here: cut its chain
        new = len(seq) - shared
        if new:
            starts.append(n)
            chunks.append(torch.as_tensor(seq[shared:], dtype=torch.long))
        head = paths[prev][:shared] if shared else torch.empty(0, dtype=torch.long)
        paths[i] = torch.cat([head, torch.arange(n, n + new)])
        n += new
        prev = i

    num_unique = n
    input_ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long)
    position_ids = torch.empty(num_unique, dtype=torch.long)
    for i, path in enumerate(paths):
        position_ids[path] = torch.arange(len(path))

    rope = None if rope_positions is None else _rope_positions(rope_positions, paths, seqs, num_unique)
    packed_routes = None if routes is None else _routes(routes, paths, seqs, num_unique)

    pad = 0
    if pad_to_multiple_of and num_unique % pad_to_multiple_of:
        pad = pad_to_multiple_of - num_unique % pad_to_multiple_of
    if pad:  # padding is one extra root chain that nothing reads
        starts.append(num_unique)
        input_ids = torch.cat([input_ids, torch.full((pad,), pad_token_id, dtype=torch.long)])
        position_ids = torch.cat([position_ids, torch.arange(pad)])
        if rope is not None:
            rope = torch.cat([rope, torch.arange(pad).expand(rope.shape[0], pad)], dim=1)
        if packed_routes is not None:
            packed_routes = torch.cat([packed_routes, packed_routes.new_full((pad, *packed_routes.shape[1:]), -1)])
    total = num_unique + pad

    segments = _segments(sorted(set(starts)), position_ids, total)
    subtree_end = torch.empty(total, dtype=torch.long)
    for start, end, sub_end in segments.tolist():
        subtree_end[start:end] = sub_end

    loss_positions, loss_targets, loss_seq, picks = [], [], [], []
    for i, (seq, path) in enumerate(zip(seqs, paths)):
        mask = torch.ones(len(seq), dtype=torch.bool) if loss_masks is None else torch.as_tensor(loss_masks[i], dtype=torch.bool)
        mask[0] = False
        t = torch.nonzero(mask).flatten()
        loss_positions.append(path[t - 1])
        loss_targets.append(torch.as_tensor(seq, dtype=torch.long)[t])
        loss_seq.append(torch.full((len(t),), i, dtype=torch.long))
        picks.append(t)

    cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.long)  # noqa: E731
    carried = {
        name: torch.cat([torch.as_tensor(values[i], dtype=torch.float32)[picks[i]] for i in range(len(seqs))])
        for name, values in (token_values or {}).items()
    }
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        subtree_end=subtree_end,
        segments=segments,
        loss_positions=cat(loss_positions),
        loss_targets=cat(loss_targets),
        loss_seq=cat(loss_seq),
        token_values=carried,
        seq_values={k: torch.as_tensor(v) for k, v in (seq_values or {}).items()},
        num_sequences=len(seqs),
        num_flat_tokens=sum(len(s) for s in seqs),
        num_unique_tokens=num_unique,
        pad_to_multiple_of=pad_to_multiple_of,
        rope_position_ids=rope,
        routes=packed_routes,
        token_support=_carried_support(token_supports, picks),
    )


def _carried_support(token_supports: Sequence[Tensor | None] | None, picks: list[Tensor]) -> Tensor | None:
    """[M, K] the trained tokens' supports, in loss-term order."""
    if token_supports is None:
        return None
    return concat_supports([(None if s is None else s[t], len(t)) for s, t in zip(token_supports, picks)])


def concat_supports(runs: Sequence[tuple[Tensor | None, int]]) -> Tensor | None:
    """Runs of tokens' supports ([length, K_i] int32 ids, -1 as padding, or None: no restriction), one after the
    other as one [sum of lengths, max K_i] tensor padded with -1; None if no run has one."""
    if all(support is None for support, _ in runs):
        return None
    width = max(support.shape[1] for support, _ in runs if support is not None)
    joined = torch.full((sum(length for _, length in runs), width), -1, dtype=torch.int32)
    start = 0
    for support, length in runs:
        if support is not None:
            joined[start : start + length, : support.shape[1]] = support
        start += length
    return joined


def _rope_positions(per_sequence: Sequence[Tensor], paths: list[Tensor], seqs: list[list[int]], num_unique: int) -> Tensor:
    """[A, num_unique] multi-axis positions of the packed tokens, checked to agree wherever sequences share one."""
    if len(per_sequence) != len(seqs):
        raise ValueError(f"{len(per_sequence)} rope position tensors for {len(seqs)} sequences")
    axes = {tuple(p.shape[:-1]) for p in per_sequence}
    for i, (positions, seq) in enumerate(zip(per_sequence, seqs)):
        if positions.dim() != 2 or positions.shape[1] != len(seq):
            raise ValueError(f"sequence {i}: rope positions of shape {tuple(positions.shape)} for {len(seq)} tokens (want [axes, tokens])")
    if len(axes) != 1:
        raise ValueError(f"rope positions with different numbers of axes: {sorted(axes)}")
    rope = torch.empty(per_sequence[0].shape[0], num_unique, dtype=torch.long)
    for positions, path in zip(per_sequence, paths):
        rope[:, path] = positions.long()
    for i, (positions, path) in enumerate(zip(per_sequence, paths)):
        if not torch.equal(rope[:, path], positions.long()):
            raise ValueError(f"sequence {i}: its rope positions differ from those of a sequence it shares a prefix with")
    return rope


def _routes(per_sequence: Sequence[Tensor], paths: list[Tensor], seqs: list[list[int]], num_unique: int) -> Tensor:
    """[num_unique, layers, top_k] routed experts of the packed tokens. A shared token is routed once: the sequences
    that hold it must agree on its experts (in any order), or they are refused; -1 (not routed) yields to a route."""
    if len(per_sequence) != len(seqs):
        raise ValueError(f"{len(per_sequence)} route tensors for {len(seqs)} sequences")
    shapes = {tuple(r.shape[1:]) for r in per_sequence}
    for i, (r, seq) in enumerate(zip(per_sequence, seqs)):
        if r.dim() != 3 or r.shape[0] != len(seq):
            raise ValueError(f"sequence {i}: routes of shape {tuple(r.shape)} for {len(seq)} tokens (want [tokens, layers, top_k])")
    if len(shapes) != 1:
        raise ValueError(f"routes with different numbers of layers or experts per token: {sorted(shapes)}")
    packed = torch.full((num_unique, *per_sequence[0].shape[1:]), -1, dtype=per_sequence[0].dtype)
    for i, (r, path) in enumerate(zip(per_sequence, paths)):
        held, given = packed[path], r.to(packed.dtype)
        both = (held[:, 0, 0] >= 0) & (given[:, 0, 0] >= 0)
        differ = both & (held.sort(-1).values != given.sort(-1).values).flatten(1).any(1)
        if bool(differ.any()):
            t = int(torch.nonzero(differ)[0])
            raise ValueError(
                f"sequence {i}: token {t} is routed to other experts than in a sequence it shares a prefix with; a shared "
                "token is routed once, so these sequences cannot share it"
            )
        packed[path] = torch.where((given[:, 0, 0] >= 0)[:, None, None], given, held)
    return packed


def _segments(starts: list[int], depth: Tensor, total: int) -> Tensor:
    """(start, end, subtree_end) per segment. A segment's subtree ends at the first later segment that starts
    no deeper than it does (depth-first order), found with a monotonic stack."""
    ends = starts[1:] + [total]
    start_depth = depth[starts].tolist() if starts else []
    sub_end = [total] * len(starts)
    stack: list[int] = []
    for k, d in enumerate(start_depth):
        while stack and start_depth[stack[-1]] >= d:
            sub_end[stack.pop()] = starts[k]
        stack.append(k)
    return torch.tensor(list(zip(starts, ends, sub_end)), dtype=torch.long).reshape(-1, 3)


class PrefixCounter:
    """The size of the prefix tree of a growing set of sequences, one sequence at a time."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}
        self.size = 0

    def added_by(self, seq: Sequence[int]) -> int:
        """Tokens ``seq`` would add to the tree."""
        node, shared = self.root, 0
        for token in seq:
            if token not in node:
                break
            node, shared = node[token], shared + 1
        return len(seq) - shared

    def added_by_all(self, seqs: Sequence[Sequence[int]]) -> int:
        """Tokens ``seqs`` together would add to the tree (what they share among themselves counted once); the
        tree is left as it is."""
        grown: dict[int, dict] = {}  # per tree node where a sequence leaves the tree: the new tokens hung under it
        added = 0
        for seq in seqs:
            node, depth = self.root, 0
            while depth < len(seq) and seq[depth] in node:
                node, depth = node[seq[depth]], depth + 1
            branch = grown.setdefault(id(node), {})
            for token in seq[depth:]:
                if token not in branch:
                    branch[token] = {}
                    added += 1
                branch = branch[token]
        return added

    def add(self, seq: Sequence[int]) -> int:
        """Add ``seq``; returns the tokens it added."""
        added = self.added_by(seq)
        node = self.root
        for token in seq:
            node = node.setdefault(token, {})
        self.size += added
        return added


def count_unique_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix tree of ``sequences`` holds, without building the layout."""
    counter = PrefixCounter()
    for seq in sequences:
        counter.add(seq)
    return counter.size
