"""The embedded default rollout engine: transformers `generate` on its own copy of the policy.

Keeping a separate copy (instead of sampling from the model being trained) is what lets
generation run in a background thread while the trainer updates its weights; `push_weights`
copies the trainer's tensors in between two `generate` calls.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import (
    AutoConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, PreTrainedModel, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

from lightning_rl.models.loading import generation_config_set_aside
from lightning_rl.models.multimodal import image_token_types
from lightning_rl.models.weights import AdapterSpec, HeldWeights, SentDigests, SparseChange, tensor_digest, verify_held
from lightning_rl.models.routing import RouteRecorder, record_routes
from lightning_rl.models.structure import auto_model_class
from lightning_rl.packing.images import stack_images
from lightning_rl.rollout.base import (
    TORCH_FLOAT_DTYPES, ImagesArg, Rollout, RolloutBatch, RolloutEngine, SamplingConfig, check_device, check_dtype, check_request, supports_of,
)


class HFRolloutEngine(RolloutEngine):
    """Samples with `model.generate` and reports the log-prob of each sampled token.

    Log-probs are those of the distribution each token was drawn from: `generate`'s processed scores
    (temperature-scaled, suppressed tokens removed, filtered and renormalised when top-k, top-p or min-p
    is on, in which case each token's support is reported with it). Each call draws from `sampling.seed`,
    or without one from a seed derived from `seed` and the call count, so runs are reproducible whether
    generation runs inline or in a background thread.

    Args:
        device: where the engine's own copy of the model runs (a run sets the policy's device when the recipe gives
            none).
        dtype: the precision of that copy (``float32``, ``bfloat16``, ``float16``); it samples in it.
        verify_weights: after each weight push, compare a digest of every tensor sent with one of the engine's
            live tensor under the same name, and stop the run on a difference (naming the tensor and version).
    """

    can_record_routes = True  # forward hooks on the model's routers (lightning_rl.models.routing)

    def __init__(
        self,
        model_name_or_path: str | PreTrainedModel,
        seed: int = 0,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        pad_token_id: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        verify_weights: bool = True,
    ) -> None:
        if isinstance(model_name_or_path, PreTrainedModel):
            model = model_name_or_path
        else:
            config = AutoConfig.from_pretrained(model_name_or_path)
            model = auto_model_class(config).from_pretrained(model_name_or_path, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        self.verify_weights = verify_weights
        self._verified: dict[str, int] | None = None  # digests the last verified push left, by name (push_changed)
        eos = eos_token_id if eos_token_id is not None else self.model.generation_config.eos_token_id
        self.eos_token_ids = tuple([eos] if isinstance(eos, int) else (eos or ()))
        pad = pad_token_id if pad_token_id is not None else self.model.generation_config.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        super().__init__(seed)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_dtype(options["dtype"], TORCH_FLOAT_DTYPES)
        check_device(options["device"])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        check_request(prompts, n, images)
        repeated = [list(own.inputs if own else ()) for own in images for _ in range(n)] if images is not None else None
        with self._lock:
            version = self._version
            seed = self._seeds.next(sampling)
            recording = record_routes(self.model) if self.record_routes else contextlib.nullcontext()
            with recording as recorded:  # draws from a generator of its own (`_Draw`), never the process's
                generator = torch.Generator(self.device).manual_seed(seed)
                completions, logprobs, supports, finished = self._sample_rows([list(p) for p in prompts for _ in range(n)], sampling, repeated, generator)
        routes = None if recorded is None else routes_of_rows(recorded, [list(p) for p in prompts for _ in range(n)], completions)
        groups = []
        for g, prompt in enumerate(prompts):
            group = []
            for k in range(g * n, (g + 1) * n):
                group.append(
                    Rollout(
                        prompt_ids=list(prompt),
                        completion_ids=completions[k],
                        logprobs=logprobs[k],
                        support=supports[k],
                        weight_version=version,
                        group_id=g,
                        finish_reason="stop" if finished[k] else "length",
                        routes=None if routes is None else routes[k],
                    )
                )
            groups.append(group)
        return RolloutBatch(groups)

    def _sample_rows(
        self, prompts: list[list[int]], sampling: SamplingConfig, images: list[list[dict[str, torch.Tensor]]] | None, generator: torch.Generator,
    ) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor | None], list[bool]]:
        """`_sample` of every row; with a repetition penalty, one call per prompt length: a row's left padding would be
        penalised as tokens it holds (transformers 5.19 does; with pad == eos, a reply was kept from ending)."""
        lengths = sorted({len(p) for p in prompts})
        if sampling.repetition_penalty == 1.0 or len(lengths) == 1:
            return self._sample(prompts, sampling, images, generator)
        results: list[Any] = [None] * len(prompts)
        for length in lengths:
            rows = [k for k, p in enumerate(prompts) if len(p) == length]
            sampled = self._sample([prompts[k] for k in rows], sampling, None if images is None else [images[k] for k in rows], generator)
            for k, row in zip(rows, zip(*sampled)):
                results[k] = row
        completions, logprobs, supports, finished = (list(column) for column in zip(*results))
        return completions, logprobs, supports, finished

    @torch.no_grad()
    def _sample(
        self, prompts: list[list[int]], sampling: SamplingConfig, images: list[list[dict[str, torch.Tensor]]] | None, generator: torch.Generator,
    ) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor | None], list[bool]]:
        width = max(len(p) for p in prompts)
        # Left padding keeps every prompt's last token in the last column, where generation continues.
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        stops = list(dict.fromkeys(self.eos_token_ids + tuple(sampling.stop_token_ids)))
        # transformers' greedy search over what `_Draw` leaves: the one token it drew from the filtered distribution
        # (transformers' own sampling draws from the process's generator, which the trainer's thread draws from too).
        draw = None if sampling.temperature == 0 else _Draw(sampling, generator)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=False,
            repetition_penalty=None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
            eos_token_id=stops or None,
            pad_token_id=self.pad_token_id,
            suppress_tokens=list(sampling.suppress_token_ids) or None,
            output_scores=draw is None,  # greedy: what each token was chosen from (sampling: `_Draw` keeps them)
            return_dict_in_generate=True,
        )
        pictures = [image for own in images or [] for image in own]
        pixels = {key: value.to(self.device) for key, value in stack_images(pictures).items()}
        if pictures:  # a model whose image tokens attend both ways gets the token types its processor gives
            pixels.update(image_token_types(self.model, input_ids.to(self.device)))
        with generation_config_set_aside(self.model):  # a checkpoint's would sample from a policy the trainer never scores
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                generation_config=config, logits_processor=LogitsProcessorList([draw] if draw else []), **pixels,
            )
        new_tokens = out.sequences[:, width:].cpu()
        # [batch, steps, vocab]: processed by temperature, suppression and the filters; what they removed is -inf
        scores = torch.stack(draw.scores if draw else out.scores, dim=1).float().cpu()
        token_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None])[..., 0]
        completions, logprobs, supports, finished = [], [], [], []
        for k, (row, row_logprobs) in enumerate(zip(new_tokens.tolist(), token_logprobs.tolist())):
            end = next((t + 1 for t, tok in enumerate(row) if tok in stops), None)
            completions.append(row[: end or len(row)])
            logprobs.append(row_logprobs[: end or len(row)])
            supports.append(supports_of(scores[k, : end or len(row)].isfinite(), sampling) if sampling.filtered else None)
            finished.append(end is not None)
        return completions, logprobs, supports, finished

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Copy each tensor into the engine's model; with `verify_weights`, then prove the model's own tensors (a tied
        one under each of its names) hold what was sent, digested in the model's dtype. Returns the seconds generation
        was held off."""
        return self._push(named_tensors, version, earlier=None)

    def push_changed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     changes: dict[str, SparseChange] | None = None) -> float:
        """`push_weights` of only the tensors that changed: every other tensor must still hold what the last verified
        push left in it. Of a tensor in ``changes``, only its changed elements are written."""
        return self._push(named_tensors, version, earlier=self._verified, changes={} if changes is None else changes)

    def take_sparse_deltas(self) -> bool:
        return True  # this engine's own copy holds what the last push wrote: the changed elements are written into it

    def write_groups(self) -> dict[str, str]:
        return {}  # each tensor is copied on its own

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, earlier: dict[str, int] | None,
              changes: dict[str, SparseChange] | None = None) -> float:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under every name
        sent = SentDigests(named_tensors, lambda name: getattr(params.get(name), "dtype", None))
        self._verified = None  # until this push is verified
        with self._lock, torch.no_grad():
            paused = time.perf_counter()
            stream = sent if self.verify_weights else named_tensors
            self._load(stream if changes is None else self._write_changes(stream, params, changes), params)
            if self.verify_weights:
                held = _digests(params)
                verify_held(sent, held, self.model.get_expanded_tied_weights_keys(all_submodels=True), version, earlier)
                self._verified = held
            self._version = version
            return time.perf_counter() - paused

    def adapter_refusal(self, adapter: AdapterSpec) -> str | None:
        return None  # peft applies on this engine's copy whatever it trains on the trainer's

    def adapter_dtype(self) -> torch.dtype | None:
        return None  # peft keeps the adapter's dtype on this engine's copy as on the trainer's

    def held_base(self) -> HeldWeights | None:
        """The base weights this engine's copy holds (under peft: each adapted layer's base layer, and the original of
        a module trained whole), by Hugging Face name; None without `verify_weights`."""
        if not self.verify_weights:
            return None
        with self._lock:
            base = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
            tensors = {}
            for name, tensor in base.state_dict(keep_vars=True).items():
                parts = name.split(".")
                if any(part.startswith("lora_") or part == "modules_to_save" for part in parts):
                    continue  # the adapter's own tensors, sent with it
                tensors[".".join(part for part in parts if part not in ("base_layer", "original_module"))] = tensor
            ties = base.get_expanded_tied_weights_keys(all_submodels=True)
            return HeldWeights(_digests(tensors), {name: t.dtype for name, t in tensors.items()}, dict(ties))

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: AdapterSpec, version: int) -> float:
        """Load the adapter's tensors into this engine's copy of the base, adapted by peft (on the first push) as the
        trainer's is; with `verify_weights`, prove every adapter tensor the engine holds is the one sent."""
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

        with self._lock:
            if not hasattr(self.model, "peft_config"):
                self.model = get_peft_model(self.model, LoraConfig(**adapter.config)).eval()
            dtypes = {name: tensor.dtype for name, tensor in get_peft_model_state_dict(self.model).items()}
        state = SentDigests(named_tensors, dtypes.get)
        received = dict(state)  # an adapter is small: received whole before generation is held off
        with self._lock, torch.no_grad():
            paused = time.perf_counter()
            loaded = set_peft_model_state_dict(self.model, received)
            if loaded.unexpected_keys:
                raise KeyError(f"push_adapter: the engine's adapter has no tensor named {loaded.unexpected_keys[0]!r}")
            if self.verify_weights:
                verify_held(state, _digests(get_peft_model_state_dict(self.model)), {}, version)
            self._version = version
            return time.perf_counter() - paused

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor]) -> None:
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"push_weights: the engine's model has no tensor named {name!r}")
            target.copy_(tensor.detach().to(target.device, target.dtype))
            del tensor  # let the stream free each gathered tensor before gathering the next

    @staticmethod
    def _write_changes(named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor],
                       changes: dict[str, SparseChange]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream less the tensors in ``changes`` (read as each passes), whose changed elements are written here
        (one this engine holds otherwise is written whole, and taken out of ``changes``)."""
        for name, tensor in named_tensors:
            change, target = changes.get(name), params.get(name)
            if change is None or target is None or not target.is_contiguous() or target.shape != tensor.shape:
                if change is not None:
                    del changes[name]  # written whole: what the sync counts as sent
                yield name, tensor
                continue
            target.view(-1)[change.index.to(target.device, torch.long)] = change.values.to(target.device, target.dtype)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]


def _digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """`tensor_digest` of each, by name; a tensor under several names (tied) is digested once."""
    by_tensor: dict[int, int] = {}
    for tensor in tensors.values():
        if id(tensor) not in by_tensor:
            by_tensor[id(tensor)] = tensor_digest(tensor)
    return {name: by_tensor[id(tensor)] for name, tensor in tensors.items()}


def routes_of_rows(recorded: RouteRecorder, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
    """Each row's routes ``[prompt + completion, layers, top_k]`` from a ``generate`` call's forwards: the first runs
    the left-padded prompts, each later one the previous step's token of every row. A row's last token is never
    forwarded (nothing reads its outputs): -1."""
    first, steps = recorded.calls[0], recorded.calls[1:]
    rows, width = len(prompts), max(len(p) for p in prompts)
    if first.shape[0] != rows * width or any(step.shape[0] != rows for step in steps):
        raise RuntimeError(
            f"generate ran forwards of {[c.shape[0] for c in recorded.calls]} tokens for {rows} prompts of {width} tokens; "
            "routes are recorded for one prompt forward and then one token per row and step"
        )
    prompt_routes = first.view(rows, width, *first.shape[1:])
    out = []
    for b, (prompt, completion) in enumerate(zip(prompts, completions)):
        decoded = [step[b] for step in steps[: max(len(completion) - 1, 0)]]
        last = first.new_full((min(len(completion), 1), *first.shape[1:]), -1)
        out.append(torch.cat([prompt_routes[b, width - len(prompt):], *(d[None] for d in decoded), last]))
    return out


class _Draw(LogitsProcessor):
    """Sampling as transformers samples (temperature, then top-k, top-p and min-p, in its order), drawn from the
    engine's own ``generator``: the scores it draws from are kept (``scores``), and it leaves the drawn token alone
    for the greedy search to take. The process's generator, which the trainer's thread draws its dropout masks from
    meanwhile (async GRPO), is neither read nor moved."""

    def __init__(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.generator = generator
        self.warpers: list[LogitsProcessor] = []
        if sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:  # 0: off
            self.warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
        if sampling.min_p:
            self.warpers.append(MinPLogitsWarper(min_p=sampling.min_p))
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.scores.append(scores)
        drawn = torch.multinomial(torch.softmax(scores.float(), dim=-1), num_samples=1, generator=self.generator)
        return torch.full_like(scores, -math.inf).scatter_(1, drawn, 0.0)
