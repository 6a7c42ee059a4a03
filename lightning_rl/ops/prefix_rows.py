"""One prefix, many rows: a group whose tree does not fit in one row forwards its shared prefix once.

The prefix (the tokens every sequence of the group shares, before any loss term reads an output) is forwarded on
its own, and every attention layer's keys and values (after rotary and the model's own transforms) are captured.
Each row of the rest (a *span*) then runs with its queries attending to those keys and values in front of its own
tree, as in the single tree they make together, positions continuing at the prefix's depth. Within the row the
prefix's keys and values are leaves, so every row's backward adds its gradient to them; after the span's last row,
one backward runs through the prefix's forward with those sums (``finish_prefix``). Loss and gradients are those
of the whole group packed in one row.

Spans nest (`packing.planner.RowPrefix`): a nested span's prefix is itself a row of its parent's, forwarded once
attending to the parent's keys and values, and it captures its whole chain's (the parent's joined in front of its
own). Its rows attend to that chain; after its last row, its backward adds to the parent's keys and values, and it
counts as one finished row of the parent.

A frozen model (the reference, or any forward without gradients) keeps its capture for the span's rows and runs no
backward. With ``recompute`` (a policy trained with gradient checkpointing), the prefix's forward keeps no graph while
the rows run: only its keys and values stay, and the forward runs again, from the same random state, for the one
backward after the last row. That costs one more forward of the prefix, and across the rows holds its keys and
values alone instead of every activation of its forward.

On several processes, a policy's rows and prefixes backpropagate without data parallelism's reduction, and its module
reduces every gradient once after them (`reduce_after_rows`; DDP): a prefix's backward runs after its rows', outside
any backward the strategy runs, and a rank's rows and spans need not number another's.

A prefix's images go with it: its forward encodes them, once for its rows (a nested prefix's, those of its own part),
and a row's own images (after the prefix) stay the row's; multi-axis positions are cut at the prefix's end as the
tokens are.

Refused in one line: an image whose placeholders run across the prefix's end (the planner stops a prefix before
one), a row or nested prefix holding images of its own where image tokens attend both ways (``auto`` keeps sub-groups
for image rollouts there), padded rows (static-shape devices), a policy sharded by FSDP2 (each layer's forward and
backward gathers and reduces its shards in step with the other ranks, and a span adds a forward and a backward of its
prefix on the ranks that have one), a policy trained on several processes by a strategy that reduces within each
backward, and the varlen kernel.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import get_device_states, set_device_states

from lightning_rl.attention.tree_attention import PackingRefused
from lightning_rl.models.multimodal import image_token_id as model_image_token
from lightning_rl.packing.images import image_runs, split_images, stack_images
from lightning_rl.packing.planner import PrefixAcrossRows, RowPlan, RowPrefix, RowTooLong, plan_rows, prefix_limits
from lightning_rl.packing.tree import PackedBatch, pack_sequences


@dataclass
class _Capture:
    keys_values: dict[int, tuple[Tensor, Tensor]]  # attention module id -> what the rows attend to (leaves where gradients flow)
    outputs: list[Tensor]  # the prefix forward's own keys and values (with its graph), when gradients flow
    rerun: Callable[[], list[Tensor]] | None = None  # recompute: what gives `outputs` for the backward


# Policies whose module backpropagates their rows without data parallelism's reduction and then reduces every gradient
# once (`reduce_after_rows`).
_REDUCED_AFTER_ROWS: weakref.WeakSet[nn.Module] = weakref.WeakSet()

# Set while a recomputed prefix's first forward runs without gradients: the prefixes it continues give the keys and
# values its backward will attend to (their capture for gradients), not a capture of their own without them.
_FOR_BACKWARD = threading.local()


class SharedPrefix:
    """The prefix of a span of ``rows`` rows: its chain of tokens as a packed batch (a nested span's: a row of its
    parent's span), and per model its captured keys and values (one capture per model, gradient mode and train/eval
    mode)."""

    def __init__(self, batch: PackedBatch, rows: int, recompute: bool = False, image_token_id: int | None = None) -> None:
        self.batch, self.rows, self.recompute, self.image_token_id = batch, rows, recompute, image_token_id
        self.finished = 0  # rows whose backward has run
        self.counted = False  # whether a row's unique tokens counted this prefix's own
        self._captures: dict[tuple[int, bool, bool, bool], _Capture] = {}

    @property
    def parent(self) -> SharedPrefix | None:
        return self.batch.prefix if isinstance(self.batch, PrefixedRow) else None

    @property
    def length(self) -> int:
        """Tokens from the sequences' start to this prefix's end (its parents' included)."""
        return self.batch.num_tokens + (self.parent.length if self.parent is not None else 0)

    @property
    def input_ids(self) -> Tensor:
        """The ``length`` tokens the rows of its span start with."""
        own = self.batch.input_ids
        return own if self.parent is None else torch.cat([self.parent.input_ids, own.to(self.parent.input_ids.device)])

    @property
    def image_inputs(self) -> dict[str, Tensor]:
        """The inputs of the images among the ``length`` tokens, in their order (its parents' first)."""
        own, above = self.batch.image_inputs, self.parent.image_inputs if self.parent is not None else {}
        if not own or not above:
            return own or above
        count = lambda ids: image_runs(ids.tolist(), self.image_token_id)  # noqa: E731
        return stack_images([*split_images(above, count(self.parent.input_ids)), *split_images(own, count(self.batch.input_ids))])

    @property
    def rope_position_ids(self) -> Tensor | None:
        """The multi-axis positions of the ``length`` tokens (None without them)."""
        own = self.batch.rope_position_ids
        return own if self.parent is None or own is None else torch.cat([self.parent.rope_position_ids, own], 1)

    @property
    def routes(self) -> Tensor | None:
        """The experts the engine routed the ``length`` tokens to (None without them)."""
        own = self.batch.routes
        return own if self.parent is None or own is None else torch.cat([self.parent.routes, own])

    @property
    def chain(self) -> list[SharedPrefix]:
        """This prefix and the ones it continues, outermost first."""
        return [self] if self.parent is None else [*self.parent.chain, self]

    def uncounted_tokens(self) -> int:
        """The tokens of this chain of prefixes no row has counted yet, now counted."""
        tokens, prefix = 0, self
        while prefix is not None and not prefix.counted:
            prefix.counted, tokens, prefix = True, tokens + prefix.batch.num_tokens, prefix.parent
        return tokens

    def finish_row(self) -> None:
        """One of its rows' backward has run: after the last, backpropagate through the prefix, and a nested
        prefix's own row of its parent is done."""
        self.finished += 1
        if self.finished == self.rows:
            self.backward()
            if self.parent is not None:
                self.parent.finish_row()

    @staticmethod
    def check(model: nn.Module) -> None:
        """Refused before any forward of a span's row (the probe's and the reference's included, so that no rank runs
        forwards the others do not): a policy that cannot train spans on several processes (`_spans_refused`)."""
        why = _spans_refused(model, grad=torch.is_grad_enabled() or getattr(_FOR_BACKWARD, "active", False))
        if why is not None:
            raise PackingRefused(f"{type(model).__name__}: a prefix forwarded once across rows (prefix_across_rows) {why}; set model.prefix_across_rows: never")

    def keys_values(self, model: nn.Module, forward) -> dict[int, tuple[Tensor, Tensor]]:
        """The prefix's keys and values for ``model``, forwarded once: ``forward(capture)`` runs the prefix's batch
        and appends (module id, key, value) per attention call to ``capture``."""
        grad = torch.is_grad_enabled() or getattr(_FOR_BACKWARD, "active", False)
        # A model forwarded another way is another entry: with gradients or not, in train or eval mode, and with its
        # LoRA adapters on or off (LoRA's reference is the policy with them off).
        key = (id(model), grad, model.training, _adapters_off(model))
        if key not in self._captures:
            recompute = grad and self.recompute
            rng = _RandomState(self.batch.input_ids) if recompute else None
            with torch.no_grad() if recompute else contextlib.nullcontext(), _for_backward(recompute):
                captured = _captured(model, forward)
            if grad:
                leaves = {m: (k.detach().requires_grad_(), v.detach().requires_grad_()) for m, k, v in captured}
                outputs = [] if recompute else [t for _, k, v in captured for t in (k, v)]
                rerun = _rerun(model, forward, rng, [m for m, _, _ in captured]) if recompute else None
                self._captures[key] = _Capture(leaves, outputs, rerun)
            else:
                self._captures[key] = _Capture({m: (k, v) for m, k, v in captured}, [])
        return self._captures[key].keys_values

    def backward(self) -> None:
        """Backpropagate the gradients the rows left on the prefix's keys and values through its forward, once."""
        for key in [key for key in self._captures if key[1]]:
            capture = self._captures.pop(key)
            grads = [t.grad for k, v in capture.keys_values.values() for t in (k, v)]
            if all(grad is None for grad in grads):
                continue
            outputs, rerun = capture.outputs, capture.rerun
            del capture  # the captured keys and values, freed before a recompute makes them again
            outputs = outputs if rerun is None else rerun()
            pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None and out.requires_grad]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], grad_tensors=[g for _, g in pairs])


@contextlib.contextmanager
def _for_backward(active: bool):
    earlier = getattr(_FOR_BACKWARD, "active", False)
    _FOR_BACKWARD.active = earlier or active
    try:
        yield
    finally:
        _FOR_BACKWARD.active = earlier


def _captured(model: nn.Module, forward) -> list[tuple[int, Tensor, Tensor]]:
    captured: list[tuple[int, Tensor, Tensor]] = []
    forward(captured)
    captured = list(captured)  # a layer recomputed in the prefix's backward appends again: not read
    if len({m for m, _, _ in captured}) != len(captured):
        raise PackingRefused(f"{type(model).__name__}: an attention module runs twice in one forward; a row cannot tell which of its prefix keys and "
                             "values to take; set model.prefix_across_rows: never")
    return captured


class _RandomState:
    """The random state a forward on ``on``'s device starts from (the host's and the accelerator's), and its autocast
    (the device's and the host's), as `torch.utils.checkpoint` keeps them, to run the forward again the same: the same
    dropout, and the same precision where the backward runs outside the forward's autocast (SFT backpropagates a span's
    last row after its training step returned)."""

    def __init__(self, on: Tensor) -> None:
        self.host = torch.get_rng_state()
        self.device_type = on.device.type
        self.devices, self.states = get_device_states(on)  # none for a CPU tensor
        self.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in {self.device_type, "cpu"}
                         if torch.amp.is_autocast_available(kind)}

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.host)
            set_device_states(self.devices, self.states, device_type=self.device_type)
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield


def _rerun(model: nn.Module, forward, rng: _RandomState, modules: list[int]) -> Callable[[], list[Tensor]]:
    """The prefix's forward again, with gradients and the random state of the first: its keys and values in the
    order the first forward captured them."""
    training = model.training

    def rerun() -> list[Tensor]:
        if model.training != training:
            raise RuntimeError(f"{type(model).__name__} left {'train' if training else 'eval'} mode between a prefix's forward and its backward")
        with torch.enable_grad(), rng.restored():
            captured = _captured(model, forward)
        if [m for m, _, _ in captured] != modules:
            raise RuntimeError(f"{type(model).__name__}: the prefix's forward, run again for its backward, took other attention modules")
        return [t for _, k, v in captured for t in (k, v)]

    return rerun


@dataclass
class PrefixedRow(PackedBatch):
    """A row of a span: its tokens follow ``prefix``'s (position ids continue at its depth; loss positions are this
    row's own)."""

    prefix: SharedPrefix | None = None

    def to(self, device: torch.device | str) -> PrefixedRow:
        moved = super().to(device)
        self.prefix.batch = self.prefix.batch.to(device)
        return PrefixedRow(**{f.name: getattr(moved, f.name) for f in fields(PackedBatch)}, prefix=self.prefix)


def cut_prefix(row: PackedBatch, prefix: SharedPrefix | int, recompute: bool = False, image_token_id: int | None = None) -> PrefixedRow:
    """``row`` (every sequence of it starting with the same tokens) without its first ``prefix`` tokens, which a
    `SharedPrefix` (new for an int length, else the one given, shared with the span's other rows) forwards;
    ``recompute``: a new one's (`SharedPrefix`). A row's images (placeholders ``image_token_id``) inside the prefix go
    with it, encoded once for the span; those after it stay the row's."""
    return _cut(row, prefix, recompute, image_token_id, counts=True)


def _cut(row: PackedBatch, prefix: SharedPrefix | int, recompute: bool, image_token_id: int | None, counts: bool) -> PrefixedRow:
    """`cut_prefix`; ``counts``: whether the row's unique tokens count the prefix's where no row has yet (not for a
    nested prefix's own chain, which is not a row of the step)."""
    length = prefix if isinstance(prefix, int) else prefix.length
    why = None
    if row.image_inputs and image_token_id is None:
        why = "its sequences carry images, and the row does not say which tokens are their placeholders"
    elif row.image_inputs and length < row.num_tokens and int(row.input_ids[length - 1]) == int(row.input_ids[length]) == image_token_id:
        why = f"an image's placeholders run across its first {length} tokens' end"
    elif row.pad_to_multiple_of:
        why = "its rows are padded to fixed lengths (static-shape devices)"
    elif not 0 < length < row.num_tokens or int(row.segments[0, 2]) != row.num_tokens or int(row.segments[0, 1]) < length:
        why = f"its first {length} tokens are not one chain every sequence starts with"
    elif row.loss_positions.numel() and int(row.loss_positions.min()) < length:
        why = f"a loss term reads an output of its first {length} tokens"
    if why is not None:
        raise PackingRefused(f"a row cannot continue a prefix forwarded apart (model.prefix_across_rows): {why}; set model.prefix_across_rows: never")
    if isinstance(prefix, int):
        prefix = _new_prefix(row, length, None, recompute, image_token_id)
    elif not torch.equal(prefix.input_ids, row.input_ids[:length]):
        raise ValueError("the rows of a span must start with the same prefix")
    prefix.rows += 1
    segments = row.segments - length
    segments[0, 0] = 0
    if int(segments[0, 1]) == 0:  # the row forks right after the prefix: its first chain is the prefix alone
        segments = segments[1:]
    return PrefixedRow(
        **{f.name: getattr(row, f.name) for f in fields(PackedBatch)} | dict(
            input_ids=row.input_ids[length:], position_ids=row.position_ids[length:], subtree_end=row.subtree_end[length:] - length,
            segments=segments, loss_positions=row.loss_positions - length,
            routes=None if row.routes is None else row.routes[length:],
            rope_position_ids=None if row.rope_position_ids is None else row.rope_position_ids[:, length:],
            image_inputs=_images(row, image_token_id, length)[1],
            # the prefixes' tokens count as forwarded by the first row that reaches them
            num_unique_tokens=row.num_unique_tokens - length + (prefix.uncounted_tokens() if counts else 0),
        ),
        prefix=prefix,
    )


def _new_prefix(row: PackedBatch, length: int, parent: SharedPrefix | None, recompute: bool, image_token_id: int | None) -> SharedPrefix:
    """The prefix of ``row``'s first ``length`` tokens, with the images and multi-axis positions there; below
    ``parent`` (a nested span's), a row of its span."""
    routes = None if row.routes is None else [row.routes[:length]]
    chain = pack_sequences([row.input_ids[:length].tolist()], [[False] * length], routes=routes).to(row.input_ids.device)
    chain.image_inputs = _images(row, image_token_id, length)[0]
    chain.rope_position_ids = None if row.rope_position_ids is None else row.rope_position_ids[:, :length]
    batch = chain if parent is None else _cut(chain, parent, recompute, image_token_id, counts=False)
    return SharedPrefix(batch, rows=0, recompute=recompute, image_token_id=image_token_id)


def _images(row: PackedBatch, image_token_id: int | None, length: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The inputs of ``row``'s images whose placeholders lie in its first ``length`` tokens, and of the rest (in row
    order, as `split_images` reads them)."""
    if not row.image_inputs:
        return {}, {}
    images = split_images(row.image_inputs, image_runs(row.input_ids.tolist(), image_token_id))
    ahead = image_runs(row.input_ids[:length].tolist(), image_token_id)
    return stack_images(images[:ahead]), stack_images(images[ahead:])


def share_prefixes(rows: list[PackedBatch], prefixes: list[RowPrefix | None], recompute: bool = False, image_token_id: int | None = None) -> list[PackedBatch]:
    """The planner's rows with each span's prefix cut off and shared: ``prefixes[k]`` is (span, prefix length) of row
    ``k``, or a nested span's chain of them, or None (`packing.planner.RowPlan.prefixes`). ``recompute``: the
    prefixes' forwards keep no graph across the rows, and run again for their backward (`SharedPrefix`)."""
    shared: dict[int, SharedPrefix] = {}
    out = []
    for row, spec in zip(rows, prefixes):
        if spec is None:
            out.append(row)
            continue
        prefix = None
        for span, length in [spec] if isinstance(spec[0], int) else spec:
            if span not in shared:
                shared[span] = _new_prefix(row, length, prefix, recompute, image_token_id)
            prefix = shared[span]
        out.append(cut_prefix(row, prefix, image_token_id=image_token_id))
    return out


def finish_prefix(row: PackedBatch) -> None:
    """After a row's backward: the span's last row backpropagates through its prefix (and a nested one's last,
    through its parent's after the parent's own last row)."""
    if isinstance(row, PrefixedRow):
        row.prefix.finish_row()


def _adapters_off(model: nn.Module) -> bool:
    """Whether a peft model runs as its base (``disable_adapter``): its adapted layers say so (peft's flag, read
    from each module's own attributes: a miss through ``nn.Module.__getattr__`` costs an exception a module)."""
    return any(vars(module).get("_disable_adapters") is True for module in model.modules())


def reduce_after_rows(model: nn.Module) -> None:
    """Declares that ``model``'s module backpropagates its rows and their prefixes without data parallelism's
    reduction, and reduces every gradient once after them (`modules.policy.PolicyModule.rows_reduced_once`): its spans
    may train on several processes."""
    _REDUCED_AFTER_ROWS.add(model)


def _spans_refused(model: nn.Module, grad: bool = True) -> str | None:
    """Why ``model`` cannot run a span here, or None: sharded by FSDP2, or trained (``grad``) on several processes by a
    module that does not reduce its gradients after its rows (`reduce_after_rows`). A frozen model's forward on plain
    tensors runs no collective and no backward: its spans run anywhere."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return ("under FSDP2, whose every forward and backward gathers and reduces each layer's shards in step with the other ranks "
                "(a span adds a forward and a backward of its prefix on the ranks that have one)")
    if grad and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and model not in _REDUCED_AFTER_ROWS:
        return ("is backpropagated after its rows, outside the strategy's backward, so this strategy's data parallelism would not "
                "reduce its gradients (DDP without static_graph does)")
    return None


def plan_step_rows(
    max_tokens: int, setting: PrefixAcrossRows, model: nn.Module, sequences: list[list[int]], loss_masks: list[list[bool]], groups: list[int], apart: bool,
    exact_across_rows: Callable[[], bool] = lambda: True,
) -> RowPlan:
    """A step's rows for a policy (``plan_rows`` with ``span_settings``); a sequence no row holds is refused naming the
    key that sets the rows. ``auto`` plans sub-groups instead of a span where ``exact_across_rows()`` (asked only
    then) says the model or its kernel cannot continue a prefix forwarded apart."""
    settings = span_settings(setting, model, loss_masks, apart, sequences)
    try:
        plan = plan_rows(sequences, max_tokens, groups=groups, **settings)
        if setting == "auto" and any(p is not None for rank in plan.prefixes for p in rank) and not exact_across_rows():
            settings["prefix_across_rows"] = "never"
            plan = plan_rows(sequences, max_tokens, groups=groups, **settings)
        return plan
    except RowTooLong as error:
        shown = "" if setting == settings["prefix_across_rows"] else (", none for this run: image rollouts whose image tokens attend both ways, static shapes, several "
                                                                      "processes, or a model or kernel that cannot")
        fix = ("set model.prefix_across_rows: auto, which forwards a shared prompt apart, or raise max_tokens_per_row"
               if settings["prefix_across_rows"] == "never" and setting == "never" else "raise max_tokens_per_row")
        raise PackingRefused(
            f"model.max_tokens_per_row={max_tokens}: a rollout of {error.length} tokens (its prompt and completion) fits no "
            f"row, and no prefix forwarded apart (model.prefix_across_rows: {setting}{shown}) leaves it within one: "
            f"{fix} (to the longest prompt plus sampling.max_new_tokens)"
        ) from None


def rows_on_every_rank(plan: Callable[[], tuple[list[list[int]], list[RowPrefix | None]]], reduce: Callable[..., Tensor],
                       device: torch.device) -> tuple[list[list[int]], list[RowPrefix | None]]:
    """This rank's rows and their prefixes from ``plan``, padded with empty rows to the most any rank has
    (``reduce``: the strategy's), so that every rank runs as many. A refusal on any rank is raised on every rank, in
    the refusing rank's words: raised on one alone, it left the others waiting in the next collective until their
    peer's exit broke it (a gloo traceback)."""
    try:
        (rows, prefixes), error = plan(), None
    except PackingRefused as refused:
        rows, prefixes, error = [], [], refused
    most, failed = (int(v) for v in reduce(torch.tensor([len(rows), error is not None], device=device), reduce_op="max").tolist())
    if failed:
        said = [str(error)] if error is not None else []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, None if error is None else str(error))
            said = [message for message in every if message]
        refusal = PackingRefused(said[0])
        refusal.on_every_rank = True  # every rank raises it: the first process says it
        raise refusal
    return rows + [[] for _ in range(most - len(rows))], prefixes + [None] * (most - len(rows))


def span_settings(setting: str, model: nn.Module, loss_masks, apart: bool, sequences=None) -> dict:
    """``plan_rows``' ``prefix_across_rows`` and ``prefix_limits`` for a policy: a prefix stops before the first
    trained token's input, and before an image's placeholders it would cut (``sequences``). ``auto`` keeps sub-groups
    where a span would be refused (``apart``: image rollouts whose image tokens attend both ways, or rows padded for a
    static-shape device; a policy `_spans_refused`); ``always`` leaves the refusal to the row."""
    if setting == "auto" and (apart or _spans_refused(model) is not None):
        setting = "never"
    return dict(prefix_across_rows=setting, prefix_limits=prefix_limits(loss_masks, sequences, model_image_token(model.config)))
