"""A rollout engine on an in-process (colocated) `vllm.LLM`.

The engine and its worker live in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while it
is built, and the "uni" executor), so `push_weights` hands the trainer's tensors to vLLM's in-place reload directly:
nothing is copied through a socket or a file. vLLM spawns processes of its own at start-up, so a script
that builds this engine needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig

from lightning_rl.rollout.base import (
    ImagesArg, PromptImages, Rollout, RolloutBatch, RolloutEngine, SamplingConfig, check_dtype, check_expanded, check_request, support_rows,
    support_too_wide, suppressing_bias,
)
from lightning_rl.models.weights import SentDigests, verify_held
from lightning_rl.rollout.checkpoint_layout import CheckpointLayout
from lightning_rl.rollout.vllm_held import held_digests, ties_of

_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType


def sampling_params_of(sampling: SamplingConfig, n: int, seed: int, vocab_size: int) -> dict[str, Any]:
    """vLLM `SamplingParams` fields for one request; `logprobs` asks for the sampled token's log-prob, and with a
    filter on for enough top log-probs to read its support off (`support_request`)."""
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
    than the widest support allowed (top_k's, else max_support's), or the whole vocabulary if smaller.

    vLLM's CPU build does not honour ``return_sampling_mask`` (it needs the V2 model runner, which needs Triton's GPU
    backends), so the support is read off the processed log-probs instead: they are those of the filtered
    distribution the token was drawn from, -inf outside it, and vLLM returns the top ones in order. Fewer finite
    entries than asked (or the whole vocabulary asked) is then the whole support, exactly; as many is a support too
    wide to have been read, refused by `support_of`."""
    if not sampling.filtered:
        return 0
    widest = min(sampling.top_k, sampling.max_support) if sampling.top_k else sampling.max_support
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
    is read off the top log-probs: `support_request`). `generate` and
    `push_weights` exclude each other, so a generation always finishes on the weights it started with.
    On a CPU, `kv_cache_memory_bytes` sizes the KV cache in host memory.

    Args:
        verify_weights: after each weight push, compare a digest of every tensor sent with one of the engine's
            live weights under the same name (`vllm_held`: fused and repacked weights read back), and stop the run
            on a difference (naming the tensor and version). Needs the whole model in one worker.
    """

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"{cls.__name__} needs vLLM, which is not installed in this Python environment (pip install 'lightning-rl[vllm]'; on a CPU, `make vllm-venv`)")
        check_dtype(options["dtype"], VLLM_DTYPES)

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
    ) -> None:
        from vllm import LLM

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
                **dict(engine_kwargs or {}),
            )
        finally:
            if previous is None:
                del os.environ[_IN_PROCESS]
            else:
                os.environ[_IN_PROCESS] = previous
        self._layout = CheckpointLayout(AutoConfig.from_pretrained(model))
        self.verify_weights = verify_weights
        # The dtype each tensor is held in (the trainer's are digested cast to it); a model whose weights cannot be
        # read back is refused here, before a run starts.
        self._held_dtypes = {name: getattr(torch, dtype) for name, (dtype, _) in self._held().items()} if verify_weights else {}
        self._vocab_size = self._llm.llm_engine.model_config.get_vocab_size()
        super().__init__(seed)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        from vllm import SamplingParams

        check_request(prompts, n, images)
        own = list(images) if images is not None else [None] * len(prompts)
        with self._lock:
            seed = self._seeds.next(sampling)
            version = self._version
            # vLLM seeds sample k of a request with seed + k: spacing prompts n apart keeps all samples distinct.
            params = [SamplingParams(**sampling_params_of(sampling, n, seed + g * n, self._vocab_size), detokenize=False)
                      for g in range(len(prompts))]
            outputs = self._llm.generate([vllm_prompt(p, i) for p, i in zip(prompts, own)], params, use_tqdm=False)
        groups = []
        for g, (prompt, output) in enumerate(zip(prompts, outputs)):
            if own[g]:
                check_expanded(type(self).__name__, g, output.prompt_token_ids, prompt)
            groups.append([
                Rollout(
                    prompt_ids=list(prompt),
                    completion_ids=list(completion.token_ids),
                    logprobs=[step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)],
                    support=support_of([[(t, e.logprob) for t, e in step.items()] for step in completion.logprobs], sampling, self._vocab_size),
                    weight_version=version,
                    group_id=g,
                    finish_reason=completion.finish_reason or "length",
                )
                for completion in output.outputs
            ])
        return RolloutBatch(groups)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Reload in place, then (with `verify_weights`) prove the live weights are what was sent. A tensor the model
        lacks raises `WeightNameError` and the version stays; tensors before it in the stream are already loaded,
        so push the full weights again."""
        sent = SentDigests(named_tensors, self._held_dtypes.get)
        weights = ((name, tensor.detach()) for name, tensor in self._layout.checked_with_ties(sent if self.verify_weights else named_tensors))
        with self._lock:
            try:
                self._reload(weights)
            except Exception:
                # An empty reload closes the interrupted one: modules that got nothing take their old weights back.
                self._reload(iter(()))
                raise
            finally:
                # Cached prefixes hold keys and values computed with the old weights, cached encoder outputs image
                # features: both are dropped (the worker's reload drops its encoder outputs, not the scheduler's record of them).
                self._llm.reset_prefix_cache()
                self._llm.llm_engine.reset_encoder_cache()
            if self.verify_weights:
                verify_held(sent, {name: digest for name, (_, digest) in self._held().items()}, ties_of(self._layout), version)
            self._version = version

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
        gc.collect()
