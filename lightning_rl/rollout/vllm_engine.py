"""A rollout engine on an in-process (colocated) `vllm.LLM`.

The engine and its worker live in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while it
is built, and the "uni" executor), so `push_weights` hands the trainer's tensors to vLLM's in-place reload directly:
nothing is copied through a socket or a file. vLLM spawns processes of its own at start-up, so a script
that builds this engine needs an `if __name__ == "__main__":` guard.

Generation across updates: `generate` runs vLLM's engine one step at a time, and a push (from another thread) lands
between two steps without waiting for the completions in flight. Their KV cache is dropped and recomputed under the
new weights (as the server's ``pause: keep``), and each completion records the version that sampled each of its
tokens (`Rollout.token_versions`): a step samples one token per running sequence, with the weights loaded then.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gc
import inspect
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from lightning_rl.rollout.base import (
    ImagesArg, PromptImages, Rollout, RolloutBatch, RolloutEngine, SamplingConfig, check_dtype, check_expanded, check_request, support_rows,
    support_too_wide, suppressing_bias,
)
from lightning_rl.errors import RecipeError
from lightning_rl.models.weights import AdapterSpec, HeldWeights, SentDigests, verify_held
from lightning_rl.rollout.checkpoint_layout import CheckpointLayout
from lightning_rl.rollout.vllm_held import (
    held_adapter, held_aliases, held_digests, lora_dtype, lora_refusal, lora_targets, prepack_on_reload, ties_of, write_groups,
)
from lightning_rl.rollout.vllm_server_process import cpu_head_size_refusal, vllm_on_cpu

_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType


# The `LLM` arguments the engine gives itself: its own (named as `VLLMEngine`'s), or fixed by how it runs.
_SET_BY_THE_ENGINE = ("model", "seed", "dtype", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager",
                      "distributed_executor_backend", "logprobs_mode", "max_logprobs", "enable_lora", "max_lora_rank", "max_loras")


def _check_engine_kwargs(engine_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`engine_kwargs`, checked: each an argument of vLLM's engine that the engine does not set itself, and vLLM's
    asynchronous scheduling refused (see `VLLMEngine`)."""
    for key in engine_kwargs or {}:
        if key in _SET_BY_THE_ENGINE:
            raise ValueError(f"engine_kwargs.{key}: set by the engine itself" + (
                f" (give it as the engine's own {key})" if key in inspect.signature(VLLMEngine).parameters else ""))
    if engine_kwargs and importlib.util.find_spec("vllm") is not None:
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        known = {field.name for field in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM).parameters)
        for key in engine_kwargs:
            if key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=1)
                raise ValueError(f"engine_kwargs.{key}: not an argument of vLLM's engine{f' (did you mean {near[0]!r}?)' if near else ''}")
    if (engine_kwargs or {}).get("async_scheduling"):
        raise ValueError("engine_kwargs.async_scheduling: true is refused: a push would land while a step's tokens are "
                         "in flight, and which weights sampled them would not be known")
    if (engine_kwargs or {}).get("enable_chunked_prefill") and vllm_on_cpu():
        raise ValueError("engine_kwargs.enable_chunked_prefill: true is refused on a CPU: vLLM's CPU build dies when it splits a "
                         "seeded request's prompt over steps (every rollout request is seeded)")
    return dict(engine_kwargs or {})


def transformers_backend_refusal(config: PretrainedConfig) -> str | None:
    """Why the model of ``config`` cannot run in this process's vLLM, or None: vLLM serves some architectures (GPT-NeoX, Phi,
    OLMo 2, StarCoder 2 in 0.32) through its Transformers backend, which rewrites transformers' own classes of that
    architecture for the whole process: the trainer's copy of the model then fails on its first forward."""
    from vllm.model_executor.models import ModelRegistry

    for arch in config.architectures or []:
        entry = ModelRegistry.models.get(arch)
        if entry is None or getattr(entry, "module_name", "").endswith(".transformers"):
            return (f"vLLM serves {arch} through its Transformers backend, which rewrites transformers' {arch} classes in "
                    "the process it runs in, and the trainer's model would then fail; run vLLM in a process of its own "
                    "(model.engine: vllm_server)")
    return None


def sampling_params_of(sampling: SamplingConfig, n: int, seed: int, vocab_size: int) -> dict[str, Any]:
    """vLLM `SamplingParams` fields for one request; `logprobs` asks for the sampled token's log-prob, and with a
    filter on for enough top log-probs to read its support off (`support_request`)."""
    if sampling.temperature == 0 and n > 1:
        raise ValueError(f"temperature 0 samples greedily: vLLM gives one completion per prompt then, not {n}")
    return {
        "n": n, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty, "stop_token_ids": list(sampling.stop_token_ids),
        "seed": seed, "logprobs": support_request(sampling, vocab_size), "logit_bias": suppressing_bias(sampling),
    }


# vLLM's processed log-probs are -inf outside the support; its HTTP server writes -inf as -9999.0.
_REMOVED = -9999.0


def support_request(sampling: SamplingConfig, vocab_size: int) -> int:
    """Top log-probs to ask per sampled token: 0 (the sampled token's alone) without a filter; with one, one more
    than the widest support read (max_support; with top_k, at most 2 x top_k + 16 of it, since top-k keeps every token
    tied with the k-th, as low-precision logits often are), or the whole vocabulary if smaller.

    vLLM's CPU build does not honour ``return_sampling_mask`` (it needs the V2 model runner, which needs Triton's GPU
    backends), so the support is read off the processed log-probs instead: they are those of the filtered
    distribution the token was drawn from, -inf outside it, and vLLM returns the top ones in order. Fewer finite
    entries than asked (or the whole vocabulary asked) is then the whole support, exactly; as many is a support too
    wide to have been read, refused by `support_of`."""
    if not sampling.filtered:
        return 0
    widest = min(2 * sampling.top_k + 16, sampling.max_support) if sampling.top_k else sampling.max_support
    return min(widest + 1, vocab_size)


def support_of(steps: Sequence[Iterable[tuple[int, float]]], sampling: SamplingConfig, vocab_size: int) -> torch.Tensor | None:
    """A completion's support ([tokens, K] ids, -1 padding) from each token's (token id, processed log-prob) top
    entries, or None without a filter."""
    asked = support_request(sampling, vocab_size)
    if not asked:
        return None
    rows = []
    for step in steps:
        kept = [token for token, logprob in step if logprob > _REMOVED]
        if len(kept) >= asked and asked < vocab_size:
            if sampling.top_k and asked <= sampling.max_support:
                raise support_too_wide(sampling, f"kept at least {asked} tokens, more than the {asked - 1} the engine reads for "
                                       "top_k (2 x top_k + 16: top-k keeps the tokens tied with the k-th)", "fewer ties (a float32 engine)")
            raise support_too_wide(sampling, f"kept at least {asked} tokens, more than the engine asked vLLM to report")
        rows.append(kept)
    return support_rows(rows, sampling)


def vllm_prompt(prompt: Sequence[int], images: PromptImages | None) -> dict[str, Any]:
    """One prompt in vLLM's input format: its tokens, or with images the template's tokens (vLLM expands each
    image's placeholder with its own copy of the model's processor) and the images as ``multi_modal_data``."""
    if not images:
        return {"prompt_token_ids": list(prompt)}
    return {"prompt_token_ids": list(images.template_ids), "multi_modal_data": {"image": list(images.images)}}


class VLLMEngine(RolloutEngine):
    """`RolloutEngine` on a colocated vLLM engine.

    Log-probs are vLLM's `processed_logprobs`: those of the temperature-scaled distribution the token
    was drawn from (with top-k, top-p or min-p filtering, of the filtered, renormalised one, whose support
    is read off the top log-probs: `support_request`). A push lands between two of `generate`'s steps (the module
    docstring), so a completion may hold tokens of several versions, each recorded. vLLM's asynchronous scheduling
    (``engine_kwargs.async_scheduling``) is off: it would have a step's tokens in flight when a push lands, so which
    weights sampled them would not be known.
    On a CPU, `kv_cache_memory_bytes` sizes the KV cache in host memory.

    Args:
        dtype: the precision vLLM loads and samples in; ``auto`` takes the model's config's, which vLLM's CPU build
            turns into bfloat16 for a float32 model (give ``float32`` for engine log-probs at the trainer's float32).
        max_model_len: the longest prompt plus completion the engine holds (None: the model's own).
        gpu_memory_utilization: the share of the GPU's memory vLLM takes (weights and KV cache).
        kv_cache_memory_bytes: the KV cache's size in bytes (on a CPU, in host memory), in place of the share.
        enforce_eager: run without CUDA graphs.
        engine_kwargs: more of vLLM's `LLM` arguments, passed as they are.
        verify_weights: after each weight push, compare a digest of every tensor sent with one of the engine's
            live weights under the same name (`vllm_held`: fused and repacked weights read back), and stop the run
            on a difference (naming the tensor and version). Needs the whole model in one worker.
        max_lora_rank: serve a LoRA adapter of up to this rank, sent alone (`push_adapter`, a recipe's
            ``weight_sync: adapter``); None: no LoRA serving, adapters arrive merged into the weights.
    """

    MOE_LORA_NEEDS_CUDA = True  # vLLM's CPU build serves no LoRA on a MoE model (`vllm_held.lora_refusal`)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"{cls.__name__} needs vLLM, which is not installed in this Python environment (pip install 'lightning-rl[vllm]'; on a CPU, `make vllm-venv`)")
        check_dtype(options["dtype"], VLLM_DTYPES)
        _check_engine_kwargs(options["engine_kwargs"])

    def __init__(
        self,
        model: str | os.PathLike,
        seed: int = 0,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        engine_kwargs: Mapping[str, Any] | None = None,
        verify_weights: bool = True,
        max_lora_rank: int | None = None,
    ) -> None:
        from vllm import LLM

        config = AutoConfig.from_pretrained(model)
        for refusal in (transformers_backend_refusal(config), cpu_head_size_refusal(config)):
            if refusal is not None:  # one line naming the key, as every recipe mistake
                raise RecipeError(f"engine: {refusal}", "engine")
        # With the "uni" executor this keeps the worker in this process, which is what lets reload_weights take
        # live tensors. vLLM reads it only while building the engine; servers started later must not inherit it.
        previous = os.environ.get(_IN_PROCESS)
        os.environ[_IN_PROCESS] = "0"
        try:
            self._llm = LLM(
                model=str(model), seed=seed, dtype=dtype, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
                enforce_eager=enforce_eager, distributed_executor_backend="uni",
                logprobs_mode="processed_logprobs", max_logprobs=-1,  # up to the whole vocabulary: a filter's support
                **({} if max_lora_rank is None else {"enable_lora": True, "max_lora_rank": served_lora_rank(max_lora_rank), "max_loras": 1}),
                # Whole prefills on a CPU (`vllm_server_process.vllm_on_cpu`).
                **{"async_scheduling": False, **({"enable_chunked_prefill": False} if vllm_on_cpu() else {}), **_check_engine_kwargs(engine_kwargs)},
            )
        except (ValueError, TypeError) as error:  # vLLM's checks of its options (pydantic's ValidationError is a ValueError)
            said = " ".join(str(error).split())
            raise RecipeError(f"engine: vLLM refused the engine's options: {said[:400]}", "engine") from None
        finally:
            if previous is None:
                del os.environ[_IN_PROCESS]
            else:
                os.environ[_IN_PROCESS] = previous
        self._layout = CheckpointLayout(config)
        self.verify_weights = verify_weights
        # The dtype each tensor is held in (the trainer's are digested cast to it); a model whose weights cannot be
        # read back is refused here, before a run starts (the engine shut down first: left to the interpreter's exit,
        # its teardown fails on process groups the run has closed by then).
        try:
            self._held_dtypes = {name: getattr(torch, dtype) for name, (dtype, _) in self._held().items()} if verify_weights else {}
        except Exception:
            self._llm.llm_engine.engine_core.shutdown()
            raise
        self._held_aliases: set[str] = self._llm.apply_model(functools.partial(held_aliases, layout=self._layout))[0]
        self._llm.apply_model(prepack_on_reload)
        self._vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        self.context_length = self._llm.llm_engine.model_config.max_model_len
        self._verified: dict[str, int] | None = None  # digests the last verified push left, by name (push_changed)
        self._packed: dict[str, list[str]] = self._llm.apply_model(_packed_modules)[0]
        self.max_lora_rank = None if max_lora_rank is None else served_lora_rank(max_lora_rank)
        self._lora_targets = self._llm.collective_rpc(lora_targets)[0] if max_lora_rank is not None else []
        self._lora_dtype = getattr(torch, self._llm.collective_rpc(lora_dtype)[0]) if max_lora_rank is not None else None
        self._adapter: Any = None  # the LoRARequest generation applies, once an adapter is pushed
        self._adapter_folder: str | None = None
        super().__init__(seed)
        # A push waiting for the lock goes before generate's next step (a step re-takes the lock at once otherwise).
        self._push_wanted = threading.Event()
        self._turn = threading.Condition(self._lock)
        self._generating = threading.Lock()  # one generate at a time: its steps run every request in the engine
        self._switches: list[tuple[dict[tuple[str, int], int], int]] = []  # per push mid-generation: tokens then, version

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        from vllm import SamplingParams

        check_request(prompts, n, images)
        own = list(images) if images is not None else [None] * len(prompts)
        with self._generating:
            with self._turn:
                seed = self._seeds.next(sampling)
                version = self._version
                self._switches = []
                # vLLM seeds sample k of a request with seed + k: spacing prompts n apart keeps all samples distinct.
                params = [SamplingParams(**sampling_params_of(sampling, n, seed + g * n, self._vocab_size), detokenize=False)
                          for g in range(len(prompts))]
                self._llm.enqueue([vllm_prompt(p, i) for p, i in zip(prompts, own)], params, use_tqdm=False,
                                  lora_request=self._adapter)
            outputs = self._run_steps()
            switches, self._switches = self._switches, []
        groups = []
        for g, (prompt, output) in enumerate(zip(prompts, outputs)):
            if own[g]:
                check_expanded(type(self).__name__, g, output.prompt_token_ids, prompt)
            rollouts = []
            for completion in output.outputs:
                versions = [version] * len(completion.token_ids)
                for sampled, new in switches:  # the tokens after a push were sampled by its weights
                    start = sampled.get((output.request_id, completion.index))
                    if start is not None:  # else finished before that push
                        versions[start:] = [new] * max(len(versions) - start, 0)
                rollouts.append(Rollout(
                    prompt_ids=list(prompt),
                    completion_ids=list(completion.token_ids),
                    logprobs=[step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)],
                    support=support_of([[(t, e.logprob) for t, e in step.items()] for step in completion.logprobs], sampling, self._vocab_size),
                    weight_version=min(versions, default=version),
                    group_id=g,
                    finish_reason=completion.finish_reason or "length",
                    token_versions=versions if len(set(versions)) > 1 else None,
                ))
            groups.append(rollouts)
        return RolloutBatch(groups)

    def _run_steps(self) -> list[Any]:
        """Step the engine until every request enqueued is finished, letting a push in between two steps; the finished
        outputs in the order of their requests (as `LLM.generate` returns them)."""
        engine, finished = self._llm.llm_engine, []
        while True:
            with self._turn:
                self._turn.wait_for(lambda: not self._push_wanted.is_set())
                if not engine.has_unfinished_requests():
                    return sorted(finished, key=lambda output: int(output.request_id))
                finished.extend(output for output in engine.step() if output.finished)

    def _in_flight(self) -> dict[tuple[str, int], int]:
        """The tokens sampled so far by each unfinished completion, by (request id, sample index), between two steps."""
        states = self._llm.llm_engine.output_processor.request_states.values()
        return {(state.external_req_id, state.request_index): state.detokenizer.num_output_tokens() for state in states}

    def _updated(self, version: int) -> None:
        """Under the lock, once `version` is loaded: completions in flight sample their next tokens with it."""
        if in_flight := self._in_flight():
            self._switches.append((in_flight, version))
        self._version = version

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Reload in place, then (with `verify_weights`) prove the live weights are what was sent. A tensor the model
        lacks raises `WeightNameError` and the version stays; tensors before it in the stream are already loaded,
        so push the full weights again. Returns the seconds generation was held off."""
        return self._push(named_tensors, version, earlier=None)

    def push_changed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """`push_weights` of only the changed tensors (whole `write_groups`): a module that gets none of its tensors
        keeps its weights, and every tensor not sent must still hold what the last verified push left in it."""
        return self._push(named_tensors, version, earlier=self._verified)

    def write_groups(self) -> dict[str, str]:
        """`vllm_held.write_groups` of the model: fused parts and a layer's experts travel together."""
        return write_groups(self._packed, self._layout.shapes)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, earlier: dict[str, int] | None) -> float:
        sent = SentDigests(named_tensors, self._held_dtypes.get)
        weights = ((name, tensor.detach()) for name, tensor in self._layout.checked_with_ties(sent if self.verify_weights else named_tensors, held_aliases=self._held_aliases))
        self._verified = None  # until this push is verified
        self._push_wanted.set()
        with self._turn:
            self._push_wanted.clear()
            self._turn.notify_all()
            paused = time.perf_counter()
            self._adapter = None  # full weights: generation applies no adapter pushed before them
            try:
                self._reload(weights)
            except Exception:
                # An empty reload closes the interrupted one: modules that got nothing take their old weights back.
                self._reload(iter(()))
                raise
            finally:
                # Cached prefixes hold keys and values computed with the old weights, cached encoder outputs image
                # features: both are dropped (the worker's reload drops its encoder outputs, not the scheduler's record of them),
                # and so are the running requests' blocks: their keys and values are recomputed under the new weights.
                self._llm.reset_prefix_cache(reset_running_requests=True)
                self._llm.llm_engine.reset_encoder_cache()
            if self.verify_weights:
                held = {name: digest for name, (_, digest) in self._held().items()}
                verify_held(sent, held, ties_of(self._layout), version, earlier)
                self._verified = held
            self._updated(version)
            return time.perf_counter() - paused

    def adapter_refusal(self, adapter: AdapterSpec) -> str | None:
        if self.max_lora_rank is None:
            return "this vLLM engine serves no LoRA adapter (set model.engine.init_args.max_lora_rank)"
        return self._llm.collective_rpc(lora_refusal)[0] or vllm_adapter_refusal(
            adapter, self.max_lora_rank, self._lora_targets, self._layout.architecture)

    def adapter_dtype(self) -> torch.dtype | None:
        return self._lora_dtype

    def held_base(self) -> HeldWeights | None:
        """The base weights the worker holds (an adapted layer's base layer), by Hugging Face name; None without
        `verify_weights`."""
        if not self.verify_weights:
            return None
        self._push_wanted.set()  # read between two steps of the generation, as a push is
        with self._turn:
            self._push_wanted.clear()
            self._turn.notify_all()
            held = self._held()
        return HeldWeights({n: digest for n, (_, digest) in held.items()}, {n: getattr(torch, dtype) for n, (dtype, _) in held.items()},
                           ties_of(self._layout))

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: AdapterSpec, version: int) -> float:
        """Write the adapter as a peft folder and load it in place under one name (vLLM loads adapters from folders);
        generation after it applies it. With `verify_weights`, each adapted layer's A and B as the worker holds them in
        the adapter's slot must be those sent (B times the scaling, as vLLM keeps it), every other layer's zero."""
        from vllm.lora.request import LoRARequest

        folder = self._adapter_folder = self._adapter_folder or tempfile.mkdtemp(prefix="lightning-rl-adapter-")
        received = write_adapter(named_tensors, adapter, folder)
        request = LoRARequest("policy", 1, folder, load_inplace=True)
        self._push_wanted.set()
        with self._turn:
            self._push_wanted.clear()
            self._turn.notify_all()
            paused = time.perf_counter()
            self._adapter = None  # until this version is loaded
            self._llm.llm_engine.add_lora(request)
            # Cached keys and values, running requests' too, were computed with the previous adapter.
            self._llm.reset_prefix_cache(reset_running_requests=True)
            if self.verify_weights:
                held = self._llm.collective_rpc(held_adapter, kwargs={"lora_id": 1, "rank": adapter.rank})[0]
                verify_adapter(received, held, adapter, version)
            self._adapter = LoRARequest("policy", 1, folder)
            self._updated(version)
            return time.perf_counter() - paused

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    def _held(self) -> dict[str, list]:
        """`held_digests` of the model, from its one worker."""
        workers = self._llm.apply_model(functools.partial(held_digests, layout=self._layout))
        if len(workers) != 1:
            raise ValueError(f"verify_weights: the model is split over {len(workers)} workers; the check reads whole "
                             "tensors from one (tensor_parallel_size 1), or set verify_weights: false")
        return workers[0]

    def close(self) -> None:
        with self._lock:
            self._llm.llm_engine.engine_core.shutdown()
            del self._llm
        if self._adapter_folder is not None:
            shutil.rmtree(self._adapter_folder, ignore_errors=True)
        gc.collect()


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def served_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of ``rank``."""
    served = next((allowed for allowed in _LORA_RANKS if allowed >= rank), None)
    if served is None:
        raise ValueError(f"max_lora_rank: {rank} is above vLLM's largest, {_LORA_RANKS[-1]}")
    return served


def _packed_modules(model: Any) -> dict[str, list[str]]:
    """vLLM's fused modules of the model and their checkpoint parts (``qkv_proj`` -> q, k, v)."""
    return {fused: list(parts) for fused, parts in getattr(type(model), "packed_modules_mapping", {}).items()}


def vllm_adapter_refusal(adapter: AdapterSpec, max_lora_rank: int, targets: Sequence[str], architecture: str) -> str | None:
    """Why vLLM cannot serve ``adapter`` (naming the module), or None: vLLM applies LoRA to the linear layers its
    model class lists, of rank up to its max_lora_rank, without a variant, bias or modules trained whole."""
    if adapter.rank > max_lora_rank:
        return (f"lora.r {adapter.rank} is above the engine's max_lora_rank {max_lora_rank} (the rank vLLM serves: the "
                "first of its allowed ranks at or above the one it was started with)")
    if pattern := next((key for key in ("rank_pattern", "alpha_pattern") if adapter.config.get(key)), None):
        # vLLM serves them, but its held A and B are read back (verify_adapter) at the config's one rank and scaling
        return f"an adapter with per-module ranks or alphas ({pattern}: {adapter.config[pattern]}) is not sent alone: its load cannot be verified"
    if adapter.modules_to_save:
        return f"vLLM cannot serve modules trained whole beside an adapter (modules_to_save: {adapter.modules_to_save[0]})"
    if adapter.unmergeable:
        return f"vLLM cannot serve a LoRA variant or LoRA bias (on {adapter.unmergeable[0]})"
    if adapter.config.get("bias", "none") != "none":  # peft trains the adapted layers' biases too: vLLM loads none
        return f"vLLM cannot serve an adapter that trains biases (bias: {adapter.config['bias']})"
    for name, kind in adapter.layers.items():
        leaf = name.rpartition(".")[2]
        if kind != "Linear" or leaf not in targets:  # a layer vLLM lists but no linear one (its embedding) is not listed back
            return f"vLLM's {architecture} serves LoRA on {', '.join(t for t in targets if t != leaf)}, not on {name} ({kind})"
    return None


def write_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: AdapterSpec, folder: str) -> dict[str, torch.Tensor]:
    """Write the adapter as peft saves one (``adapter_model.safetensors``, ``adapter_config.json``); returns its tensors."""
    from safetensors.torch import save_file

    received = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    save_file(received, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as config:
        json.dump(adapter.config, config)
    return received


def verify_adapter(received: Mapping[str, torch.Tensor], held: Mapping[str, list], adapter: AdapterSpec, version: int) -> None:
    """`verify_held` for an adapter vLLM holds: A cast to the dtype held, B cast and multiplied by the scaling as vLLM
    does on loading; a layer the adapter does not adapt must hold zeros (whose digest is 0)."""
    dtypes = {name: getattr(torch, dtype) for name, (dtype, _) in held.items()}

    def as_held(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(dtypes.get(name, tensor.dtype))
        return tensor * adapter.scaling if ".lora_B." in name else tensor

    sent = SentDigests(((name, as_held(name, tensor)) for name, tensor in received.items()), lambda name: None)
    for _ in sent:
        pass
    verify_held(sent, {name: digest for name, (_, digest) in held.items()}, {}, version, earlier=dict.fromkeys(held, 0))
