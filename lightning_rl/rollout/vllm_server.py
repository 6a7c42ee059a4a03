"""A rollout engine that talks to a separate `vllm serve` process over HTTP.

Generation goes through vLLM's token-in/token-out route (`/inference/v1/generate`), which also
reports the weight version each token was sampled with. Weights go through vLLM's weight-transfer
routes: the server is paused (by default in-flight requests are frozen, and continue under the new weights once the
update is in: generation across updates, see ``pause``), each chunk's manifest is
posted while its bytes are broadcast over the transfer group, and the update is committed under the
new version before generation resumes. The group is one of two transports, with the same checkpoint
names (`CheckpointLayout`) on both:

- gloo (`gloo_transport`, served by `vllm_gloo_backend`): host memory and TCP, so it runs wherever vLLM
  does (the CPU build too); the trainer side needs only torch, vLLM may live in another environment.
- nccl (`nccl_transport`, vLLM's own NCCL backend and trainer engine): GPU to GPU; the trainer needs CUDA
  and vLLM. Untested here for lack of a GPU.

`VLLMServer` (in `vllm_server_process`) starts and stops a server process for a single-machine run.

A server started here heals: when it dies (killed, or its process exits) the engine starts it again, pushes it the
last weights it was sent (verified, with `verify_weights`), and sends again every request it had not answered (each
keeps its seed). After `engine_max_restarts` restarts, or on a request left unanswered for `request_timeout` (a hung
server), the run stops with one line naming the server and its last log lines (`EngineFailedError`).
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import io
import logging
import os
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import torch

from lightning_rl.errors import RecipeError, UserError
from lightning_rl.models.weights import AdapterSpec, HeldWeights, SentDigests, SparseChange, verify_held
from lightning_rl.rollout import gloo_transport
from lightning_rl.rollout.base import INTERRUPTED, GenerationInterrupted, ImagesArg, PromptImages, Rollout, RolloutBatch, RolloutEngine, SamplingConfig, check_dtype, check_expanded, check_request
from lightning_rl.rollout.vllm_engine import VLLM_DTYPES, sampling_params_of, served_lora_rank, support_of, verify_adapter, vllm_adapter_refusal
from lightning_rl.rollout.vllm_held import write_groups
from lightning_rl.rollout.vllm_server_process import (
    WEIGHT_TRANSFER_BACKENDS, VLLMServer, VLLMServerError, VLLMServerTimeout, cpu_head_size_refusal, engine_flags_refusal, request_json,
    split_prefills_refusal,
)
from lightning_rl.stopping import signalled

if TYPE_CHECKING:
    from lightning_rl.rollout.nccl_transport import NCCLSender

log = logging.getLogger(__name__)

T = TypeVar("T")
ADAPTER = "policy"  # the served name of the LoRA adapter sent alone (the server's one adapter, lora id 1)
Transport = Literal["auto", "gloo", "nccl"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)


def nccl_unavailable() -> str | None:
    """Why this process cannot send weights over NCCL, or None if it can."""
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM in the trainer's environment (its NCCL trainer engine sends the weights)"
    if not torch.cuda.is_available():
        return "needs CUDA, and torch.cuda.is_available() is False here"
    return None


def resolve_transport(transport: str, server_backend: str | None = None) -> str:
    """The weight transport to use: "gloo" or "nccl".

    "auto" is nccl when this process can send over it (CUDA and vLLM both here), else gloo. With
    `server_backend`, the backend a running server was started with, "auto" is that backend and any
    other choice must equal it: the server's backend cannot change after it starts.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    if server_backend is not None and transport not in ("auto", server_backend):
        raise ValueError(f"transport {transport!r} asked for, but the server runs the {server_backend!r} backend")
    transport = server_backend or transport
    missing = nccl_unavailable()
    if transport == "auto":
        return "gloo" if missing else "nccl"
    if transport == "nccl" and missing:
        raise ValueError(f"transport 'nccl' {missing}; use transport 'gloo'")
    return transport


def served_config_refusal(url: str, config: Mapping[str, Any]) -> str | None:
    """Why a server given by `url` (its ``/server_info`` ``vllm_config``) cannot serve rollouts, or None:
    - it reports log-probs other than those of the distribution it samples from (``--logprobs-mode``), or fewer top
      log-probs than a sampling filter's support needs (``--max-logprobs``): the trainer would correct and score
      against other numbers;
    - on a CPU with chunked prefill on, vLLM dies on the first step that splits a seeded request's prefill
      (`vllm_on_cpu`)."""
    model = config.get("model_config") or {}
    mode = str(model.get("logprobs_mode", "processed_logprobs")).lower()
    if not mode.endswith("processed_logprobs") or model.get("max_logprobs", -1) != -1:
        return (f"the vLLM server at {url} runs with logprobs_mode {model.get('logprobs_mode')!r} and max_logprobs "
                f"{model.get('max_logprobs')!r}: rollouts need the log-probs of the distribution sampled from, and a filter's "
                "whole support; start it with --logprobs-mode processed_logprobs --max-logprobs -1")
    on_cpu = (config.get("device_config") or {}).get("device") == "cpu"
    if on_cpu and (config.get("scheduler_config") or {}).get("enable_chunked_prefill"):
        return (f"the vLLM server at {url} runs on a CPU with chunked prefill on: vLLM's CPU build dies when it splits a "
                "seeded request's prompt over steps (every rollout request is seeded); start it with --no-enable-chunked-prefill")
    return None


def token_versions(spans: Sequence[Mapping[str, Any]], length: int, unlabelled: int) -> list[int]:
    """The weight version of each of a completion's `length` tokens, from vLLM's spans (``version``, ``start``,
    ``end``: the label `push_weights` commits); a token no numeric label covers was sampled at `unlabelled`."""
    versions = [unlabelled] * length
    for span in spans:
        if str(span.get("version")).isdigit():
            start, end = int(span["start"]), min(int(span["end"]), length)
            versions[start:end] = [int(span["version"])] * max(end - start, 0)
    return versions


class ServerStartError(UserError, VLLMServerError):
    """A vLLM server this engine could not start (a flag vLLM refuses, a port taken) or reach (a ``url`` that does not
    answer): one line, before the run trains."""

    key = "engine"


def _one_line(error: BaseException, most: int = 600) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= most else f"{text[:most]}..."


class EngineFailedError(UserError, VLLMServerError):
    """The vLLM server died more often than ``engine_max_restarts`` allows, or left a request unanswered for
    ``request_timeout``: the run ends (exit 1) with one line naming the server and its last log lines."""

    key = "engine"
    exit_code = 1


def _request_prompt(prompt: Sequence[int], images: PromptImages | None) -> dict[str, Any]:
    """The prompt fields of a generate request: its tokens, or with images the template's tokens and each image as
    a PNG data URL (the server's processor expands the placeholders and reports the prompt it expanded)."""
    if not images:
        return {"token_ids": list(prompt)}
    parts = []
    for image in images.images:
        png = io.BytesIO()
        image.save(png, format="PNG")
        parts.append({"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()})
    return {"token_ids": list(images.template_ids), "content_parts": parts, "return_token_ids": True}


class VLLMServerEngine(RolloutEngine):
    """`RolloutEngine` over a vLLM server: the one at `url`, or without it one started here for `model`.

    A server started here (with `server_options` for `VLLMServer`) is stopped by `close`. A server
    given by `url` must run with the flags `VLLMServer` passes. `transfer_address` is the address
    of this (trainer) machine as the server reaches it; the transfer group opens on the first
    `push_weights`. Chunks of about `chunk_bytes` bound the memory a push holds at once (over nccl:
    the size of vLLM's packed buffers, fixed when the group opens).

    `transport` ("auto", "gloo" or "nccl", see `resolve_transport`) picks how the weights travel. A
    server started here is started with the resolved backend; for a server at `url`, "auto" is the
    backend it runs (read from its `/server_info`). nccl needs `model`: its config maps the pushed
    names (`CheckpointLayout`), and a name it lacks is refused with `WeightNameError` before the push.

    Args:
        url: a running server to use (started with the flags `VLLMServer` passes); None: start one here.
        server_options: the options of the server started here (`VLLMServer`): ``dtype`` (``auto`` turns a float32
            model into bfloat16 on vLLM's CPU build), ``max_model_len``, ``kv_cache_memory_bytes``,
            ``gpu_memory_utilization`` (None: vLLM's default on a GPU, 0.3 of the host's memory on a CPU, which the
            trainer shares), ``enforce_eager``,
            ``whole_prefills`` (chunked prefill off; the default on a CPU, which needs it), ``on_cpu`` (whether the
            server runs on a CPU, which sets those two defaults; None: this machine's vLLM says), ``extra_args`` (more
            ``vllm serve`` flags), ``env``, ``log_path``, ``host``, ``port``, ``python`` (the interpreter of an
            environment with vLLM).
        transfer_address: this (trainer) machine's address as the server reaches it, for the weight transfer.
        chunk_bytes: about how many bytes a push sends at once (over nccl: vLLM's packed buffers, fixed when the
            transfer group opens).
        transfer_timeout: seconds the weight-transfer group may take to open, and a push to land.
        max_concurrent_requests: requests sent to the server at once.
        transport: how weights travel: ``gloo``, ``nccl`` (GPUs), or ``auto`` (`resolve_transport`).
        pause: what a weight push does with the requests in flight. ``keep`` (generation across updates): freezes
            them, loads the new weights, recomputes their KV cache under them (and drops the prefix cache), and lets
            them continue, so a completion holds tokens of two or more versions, each recorded
            (`Rollout.token_versions`). ``wait``: lets them finish on the old weights first, so the push waits for the
            longest completion in flight.
        verify_weights: after each weight push, compare a digest of every tensor sent with one of the server's live
            weights under the same name (read by its worker, `vllm_held`), and stop the run on a difference (naming
            the tensor and version). The same check over either transport; needs a server of one worker.
        request_timeout: seconds a request (a whole completion) may go unanswered before the server is taken for hung
            and the run stops, naming it.
        engine_max_restarts: how many times a server started here is restarted after it dies; the engine then keeps
            a host-memory copy of the last weights pushed (the model's size, twice during a push) to re-sync a restarted
            server. 0: none
            kept, and the first death stops the run. A server given by ``url`` is not restarted.
        stage_weights: over gloo, a push (full or delta) is received on the server while it goes on generating, into
            host memory there (one more copy of what is pushed, on the server's machine), and the server is paused
            only to load it; false: paused for the whole transfer, which then holds one chunk at a time.
        max_lora_rank: start the server serving a LoRA adapter of up to this rank, sent alone (`push_adapter`, a
            recipe's ``weight_sync: adapter``): the server keeps the base weights it loaded, and each sync stages the
            adapter on the server while it generates, then pauses it only to load the adapter in place. None: no
            LoRA serving (a server given by ``url`` serves one if it was started with ``--enable-lora``).
    """

    MOE_LORA_NEEDS_CUDA = True  # vLLM's CPU build serves no LoRA on a MoE model (`vllm_held.lora_refusal`)

    @property
    def concurrent_batches(self) -> bool:  # type: ignore[override]
        """The server batches the requests of several threads together. Under ``pause: wait`` a push waits for every
        request in flight, so a batch started early would only hold the next push longer (on the CPU benchmark,
        ``grpo_async_overlap.py``'s ``async``, it cost a third of the tokens/s): only ``keep`` starts batches early."""
        return self.pause == "keep"

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        for key in ("request_timeout", "transfer_timeout"):
            if not options[key] > 0:
                raise ValueError(f"{key} must be > 0 (seconds), got {options[key]}")
        for key, least in (("engine_max_restarts", 0), ("max_concurrent_requests", 1), ("chunk_bytes", 1)):
            if isinstance(options[key], bool) or not isinstance(options[key], int) or options[key] < least:
                raise ValueError(f"{key} must be an integer >= {least}, got {options[key]!r}")
        url = options["url"]
        parts = urllib.parse.urlsplit(str(url)) if url is not None else None
        if parts is not None and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise ValueError(f"url must be a server's http(s)://HOST:PORT, got {url!r}")
        if parts is not None and parts.path.strip("/"):  # the OpenAI-style base URL: this engine's routes are the server's own
            raise ValueError(f"url must be a server's http(s)://HOST:PORT, without a path, got {url!r} (drop {parts.path!r})")
        taken = set(inspect.signature(VLLMServer.__init__).parameters) - {"self", "model", "seed", "transport", "max_lora_rank"}
        if unknown := sorted(set(options["server_options"] or {}) - taken):
            raise ValueError(f"server_options: unknown {', '.join(map(repr, unknown))} (it takes {', '.join(sorted(taken))}; "
                             "vLLM's own flags go in extra_args)")
        if "dtype" in (options["server_options"] or {}):  # refused now, not by the server after its start-up
            try:
                check_dtype(options["server_options"]["dtype"], VLLM_DTYPES)
            except ValueError as error:
                raise ValueError(f"server_options.{error}") from None
        server = options["server_options"] or {}
        if options["url"] is None and (why := split_prefills_refusal(server.get("whole_prefills"), server.get("extra_args") or ())):
            raise ValueError(f"server_options.{why}")
        if why := engine_flags_refusal(server.get("extra_args") or ()):
            raise ValueError(f"server_options.{why}")
        if options["url"] is None and "python" not in (options["server_options"] or {}) and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                f"{cls.__name__} starts its vLLM server with this Python, which has no vLLM installed: install it "
                "(pip install 'lightning-rl[vllm]'), or give server_options.python (an interpreter that has it) or url"
            )
        if options["transport"] == "nccl" and (why := nccl_unavailable()):
            raise ValueError(f"transport: 'nccl' {why}")

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        seed: int = 0,
        *,
        url: str | None = None,
        server_options: Mapping[str, Any] | None = None,
        transfer_address: str = "127.0.0.1",
        chunk_bytes: int = gloo_transport.DEFAULT_CHUNK_BYTES,
        stage_weights: bool = True,
        request_timeout: float = 600.0,
        transfer_timeout: float = 300.0,
        max_concurrent_requests: int = 64,
        transport: Transport = "auto",
        verify_weights: bool = True,
        engine_max_restarts: int = 3,
        pause: Literal["keep", "wait"] = "keep",
        max_lora_rank: int | None = None,
    ) -> None:
        if url is None and model is None:
            raise ValueError("VLLMServerEngine needs the url of a running server or a model to start one for")
        if engine_max_restarts < 0:
            raise ValueError(f"engine_max_restarts: must be >= 0, got {engine_max_restarts}")
        if pause not in ("keep", "wait"):
            raise ValueError(f"pause must be 'keep' or 'wait', got {pause!r}")
        self.pause = pause
        self.request_timeout = request_timeout
        try:
            self.transport = resolve_transport(transport, None if url is None else self._backend_of(url.rstrip("/")))
        except VLLMServerError as error:
            raise ServerStartError(f"url: the vLLM server at {url} does not answer ({_one_line(error)})") from None
        if self.transport == "nccl" and model is None:
            raise ValueError("transport 'nccl' needs the model, whose config names the tensors the server holds")
        self.model = model
        self.server = None
        if url is None:
            from transformers import AutoConfig

            if why := cpu_head_size_refusal(AutoConfig.from_pretrained(model)):  # its first rollout would kill it
                raise RecipeError(f"engine: {why}", "engine")
            lora = {} if max_lora_rank is None else {"max_lora_rank": served_lora_rank(max_lora_rank)}
            try:
                self.server = VLLMServer(model, seed=seed, transport=self.transport, **lora, **dict(server_options or {})).start()
            except VLLMServerError as error:
                raise ServerStartError(f"the vLLM server did not start: {_one_line(error)}") from None
        # A server started here must not outlive this process, even if close is never called.
        self._stop_server = weakref.finalize(self, self.server.stop) if self.server is not None else None
        self.url = (url or self.server.url).rstrip("/")
        self.transfer_address = transfer_address
        self.chunk_bytes = chunk_bytes
        self.stage_weights = stage_weights
        self.transfer_timeout = timedelta(seconds=transfer_timeout)
        self._pool = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="vllm-generate")
        # Weight-transfer posts get their own thread: generate requests held by a paused server must not starve them.
        self._control = ThreadPoolExecutor(1, thread_name_prefix="vllm-weights")
        self._group: torch.distributed.ProcessGroupGloo | None = None
        self._nccl: NCCLSender | None = None
        self._vocab: int | None = None
        self.verify_weights = verify_weights
        self._held_dtypes: dict[str, torch.dtype] | None = None  # as the server holds each, read at the first push
        self.engine_max_restarts = engine_max_restarts if self.server is not None else 0
        self.restarts = 0
        self._lives = 0  # counts the server's starts: a request that failed in an earlier life is just sent again
        self._kept: dict[str, torch.Tensor] | None = None  # the weights last pushed (and changed since), to re-sync a restart
        self._kept_adapter: tuple[dict[str, torch.Tensor], AdapterSpec] | None = None  # likewise, the adapter
        self._verified: dict[str, int] | None = None  # digests the last verified push left, by name (push_changed)
        self._keep_sent = False  # the worker keeps a copy of each tensor pushed, for deltas' changed elements
        self._adapter_loaded = False  # generation names the adapter once one is loaded
        self._info: dict[str, Any] | None = None  # the worker's `lightning_rl_model_info`
        self._context: int | None = None  # the server's max_model_len, read once
        self._interrupts = 0  # counts `interrupt` calls: a generate call that sees it change was cut
        self._cut_under_signal = False  # an `interrupt` came while a stop signal stood (`cut_standing`)
        super().__init__(seed)
        # Reentrant: a push that finds the server dead restarts it (and re-pushes) under the lock it holds.
        self._lock = threading.RLock()
        if url is not None and model is not None:
            try:
                other = self._serves_another_model()
            except VLLMServerError as error:
                other = f"it does not answer as a server started with the flags VLLMServer passes ({_one_line(error, 300)})"
            if other is not None:
                self.close()
                raise ServerStartError(f"url: the vLLM server at {self.url} cannot serve this run's {model}: {other}")

    def _serves_another_model(self) -> str | None:
        """How the checkpoint the server loaded differs from the run's model (its first tensor of another name or
        shape), or None where they agree: a server given by ``url`` may have been started with any model."""
        from transformers import AutoConfig

        from lightning_rl.rollout.checkpoint_layout import CheckpointLayout

        served = {name: tuple(shape) for name, shape in (self._model_info().get("shapes") or {}).items()}
        ours = CheckpointLayout(AutoConfig.from_pretrained(self.model)).shapes
        if not served or served == ours:
            return None
        source = (self._server_config().get("model_config") or {}).get("model")
        loaded = f"it serves {source} ({self._model_info()['architecture']})"
        shape = lambda shapes, name: str(shapes[name]) if name in shapes else "absent"  # noqa: E731
        name = next(name for name in [*ours, *served] if ours.get(name) != served.get(name))
        return f"{loaded}, where '{name}' is {shape(served, name)}, and {shape(ours, name)} in this run's model"

    def _post(self, route: str, body: Any | None = None, timeout: float | None = None) -> Any:
        return request_json(f"{self.url}/{route}", body, timeout or self.request_timeout)

    def _backend_of(self, url: str) -> str:
        """The weight-transfer backend the server at `url` was started with; a server that would die on a rollout
        request, or report other log-probs, is refused (`served_config_refusal`)."""
        info = request_json(f"{url}/server_info?config_format=json", None, self.request_timeout, "GET")
        if (refusal := served_config_refusal(url, info.get("vllm_config") or {})) is not None:
            raise VLLMServerError(refusal)
        backend = ((info.get("vllm_config") or {}).get("weight_transfer_config") or {}).get("backend")
        if backend not in WEIGHT_TRANSFER_BACKENDS:
            raise VLLMServerError(f"{url} runs weight-transfer backend {backend!r}, not one of "
                                  f"{', '.join(WEIGHT_TRANSFER_BACKENDS)}: start it with the flags VLLMServer passes")
        return backend

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, images: ImagesArg = None) -> RolloutBatch:
        check_request(prompts, n, images)
        own = list(images) if images is not None else [None] * len(prompts)
        with self._lock:
            seed = self._seeds.next(sampling)
            started = self._version  # the version of tokens no span labels: sampled before the server's first label
            interrupts = self._interrupts - self.cut_standing()  # a call that starts while a cut stands is cut at once
        vocab_size = self._vocab_size() if sampling.filtered else 0  # bounds the top log-probs a support asks for
        # vLLM seeds sample k of a request with seed + k: spacing prompts n apart keeps all samples distinct.
        bodies = [
            {**_request_prompt(prompt, own[g]), "sampling_params": sampling_params_of(sampling, n, seed + g * n, vocab_size),
             "output_mode": "tokens", **({"model": ADAPTER} if self._adapter_loaded else {})}
            for g, prompt in enumerate(prompts)
        ]

        def post(body: dict[str, Any]) -> dict[str, Any] | None:  # None: not sent, the generation being cut first
            return None if self._interrupts != interrupts else self._healing(lambda: self._post("inference/v1/generate", body))

        requests = [self._pool.submit(post, body) for body in bodies]
        responses = [request.result() for request in requests]
        for g, (prompt, response) in enumerate(zip(prompts, responses)):
            if own[g] and response is not None:
                check_expanded(type(self).__name__, g, response.get("prompt_token_ids") or (), prompt)
        # Cut by `interrupt`, or by another process's on a server they share: a stop signal reaches every rank at once.
        cut = self._interrupts != interrupts or (signalled() and any(
            choice.get("finish_reason") == "abort" for response in responses if response is not None for choice in response["choices"]))
        batch = RolloutBatch([
            self._group_of(g, list(prompt), response, sampling, vocab_size, started, cut) if response is not None
            else [Rollout(list(prompt), [], [], started, g, finish_reason=INTERRUPTED) for _ in range(n)]
            for g, (prompt, response) in enumerate(zip(prompts, responses))
        ])
        if cut:
            raise GenerationInterrupted(batch)
        return batch

    def cut_standing(self) -> bool:
        """Whether an `interrupt` came and the stop signal it came for still stands: a `generate` call that starts now
        is cut at once, sampling nothing (another group of a continuation, a later round or turn of the batch that was
        cut), so that the save does not wait for it. A run that goes on after all (the signal withdrawn) samples again."""
        if not signalled():
            self._cut_under_signal = False  # withdrawn: a later signal's cut is its own interrupt's
        return self._cut_under_signal

    def interrupt(self) -> bool:
        """Abort every request the server runs (vLLM's ``pause?mode=abort``; each answers with the tokens it holds),
        then let it serve again. On a server other runs share, their requests in flight are aborted too (they see an
        engine failure, and leave those samples out); a stop signal reaches every rank of this run at once."""
        with self._lock:
            self._interrupts += 1
            self._cut_under_signal = signalled()
        try:
            self._post("pause?mode=abort")
            self._post("resume")
        except VLLMServerError as error:
            log.warning("could not cut the generation in flight on the vLLM server at %s (%s): the batch is sampled again "
                        "after the resume", self.url, _one_line(error))
            return False
        return True

    def _vocab_size(self) -> int:
        """The model's vocabulary size (its config's: this engine's model, else the one the server loaded)."""
        if self._vocab is None:
            from transformers import AutoConfig

            source = self.model
            if source is None:
                info = request_json(f"{self.url}/server_info?config_format=json", None, self.request_timeout, "GET")
                source = info["vllm_config"]["model_config"]["model"]
            self._vocab = int(AutoConfig.from_pretrained(source).get_text_config().vocab_size)
        return self._vocab

    def _group_of(
        self, group_id: int, prompt: list[int], response: dict[str, Any], sampling: SamplingConfig, vocab_size: int, started: int,
        cut: bool = False,
    ) -> list[Rollout]:
        """One prompt's samples; ``cut``: the call was interrupted, and a sample vLLM aborted was cut by it."""
        rollouts = []
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            content = (choice.get("logprobs") or {}).get("content") or []
            versions = token_versions(choice.get("weight_versions") or [], len(choice["token_ids"]), started)
            aborted = choice.get("finish_reason") == "abort"
            # The oldest weights that produced any token of the completion bound its staleness.
            version = min(versions, default=started)
            rollouts.append(Rollout(
                prompt_ids=prompt,
                completion_ids=list(choice["token_ids"]),
                logprobs=[entry["logprob"] for entry in content],
                support=support_of([[(top["token_id"], top["logprob"]) for top in entry.get("top_logprobs") or ()] for entry in content],
                                   sampling, vocab_size),
                weight_version=version,
                group_id=group_id,
                finish_reason=INTERRUPTED if cut and aborted else choice.get("finish_reason") or "length",
                token_versions=versions if len(set(versions)) > 1 else None,
                # vLLM ended the request itself (aborted): a cut the model did not make.
                infra_failure="engine" if aborted and not cut else None,
            ))
        return rollouts

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Stream the weights to the server as `version`; returns the seconds the server was paused.

        Over gloo, a refused chunk (a name or shape the model lacks) is refused whole by the server, which keeps
        serving with the version unchanged; chunks it had already loaded stay loaded, so push the full weights
        again. Over nccl, such a name is refused here, before the server pauses, and nothing is sent.
        """
        return self._push(named_tensors, version, changed=False)

    def push_changed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     changes: Mapping[str, SparseChange] | None = None) -> float:
        """`push_weights` of only the changed tensors (whole `write_groups`): vLLM's layerwise reload rebuilds the
        modules that get tensors and leaves the others as they are, and every tensor not sent must still hold what
        the last verified push left in it. Of a tensor in ``changes`` only its changed elements travel (over gloo),
        written by the worker into its copy of what it was sent last."""
        return self._push(named_tensors, version, changed=True, changes={} if changes is None else changes)

    def take_sparse_deltas(self) -> bool:
        """Over gloo: yes, and from now on the server's worker keeps a copy of each tensor pushed (its host's memory)."""
        self._keep_sent = self._keep_sent or self.transport == "gloo"
        return self._keep_sent

    def write_groups(self) -> dict[str, str]:
        """`vllm_held.write_groups` of the server's model: fused parts and a layer's experts travel together."""
        from transformers import AutoConfig

        from lightning_rl.rollout.checkpoint_layout import CheckpointLayout

        names = CheckpointLayout(AutoConfig.from_pretrained(self._model_source())).shapes
        return write_groups(self._model_info()["packed"], names)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, changed: bool,
              changes: Mapping[str, SparseChange] | None = None) -> float:
        with self._lock:
            if self.engine_max_restarts:  # kept whole: a restart mid-push sends them again, and so does a later one
                named_tensors = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_tensors]
            earlier = self._verified if changed else None
            self._adapter_loaded, self._kept_adapter = False, None  # full weights: no adapter pushed before them applies
            paused = self._healing(lambda: self._push_verified(named_tensors, version, earlier, changes))
            self._version = version
            if self.engine_max_restarts:  # a delta on top of the weights kept: together, all the server holds
                self._kept = {**(self._kept or {}), **dict(named_tensors)} if changed else dict(named_tensors)
            return paused

    def _push_verified(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       earlier: dict[str, int] | None = None, changes: Mapping[str, SparseChange] | None = None) -> float:
        """Push, then (with `verify_weights`) prove the worker holds what was sent; ``changes``: a delta's (None: every
        weight is sent)."""
        if self.verify_weights and self._held_dtypes is None:  # before the push: mid-update the server has no weights
            self._held_dtypes = {n: getattr(torch, dtype) for n, (dtype, _) in self._held()["tensors"].items()}
        sent = SentDigests(named_tensors, self._held_dtypes.get) if self.verify_weights else None
        self._verified = None  # until this push is verified
        if self.transport == "nccl":
            paused = self._push_nccl(sent or named_tensors, version)
        else:
            stream = sent or named_tensors
            paused = self._push_gloo(stream, version) if changes is None else self._push_gloo(stream, version, changes)
        if sent is not None:  # one check for both transports: what the server's worker holds once the push is in
            held = self._held()
            digests = {name: digest for name, (_, digest) in held["tensors"].items()}
            verify_held(sent, digests, held["ties"], version, earlier)
            self._verified = digests
        return paused

    def adapter_refusal(self, adapter: AdapterSpec) -> str | None:
        if self.transport != "gloo":
            return "an adapter sent alone travels over the gloo transport, and this server's is nccl"
        lora = (self._server_config().get("lora_config") or {})
        if not lora.get("max_lora_rank"):
            return "this vLLM server serves no LoRA adapter (set model.engine.init_args.max_lora_rank)"
        info = self._model_info()
        return info["lora_refusal"] or vllm_adapter_refusal(adapter, int(lora["max_lora_rank"]), info["lora_targets"], info["architecture"])

    def adapter_dtype(self) -> torch.dtype | None:
        held = self._model_info()["lora_dtype"]
        return getattr(torch, held) if held else None

    def held_base(self) -> HeldWeights | None:
        """The base weights the server's worker holds (an adapted layer's base layer), by Hugging Face name; None
        without `verify_weights`."""
        if not self.verify_weights:
            return None
        with self._lock:
            held = self._healing(self._held)
        return HeldWeights({n: digest for n, (_, digest) in held["tensors"].items()},
                           {n: getattr(torch, dtype) for n, (dtype, _) in held["tensors"].items()}, dict(held["ties"]))

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: AdapterSpec, version: int) -> float:
        """Send the adapter alone as `version`: staged on the server while it keeps generating (its worker receives
        it and writes it as a peft folder there), then the server is paused only to load it in place under one name;
        generation after it applies it. With `verify_weights`, each adapted layer's A and B as the worker holds them
        must be those sent (`vllm_engine.verify_adapter`). Returns the seconds the server was paused."""
        with self._lock:
            received = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
            paused = self._healing(lambda: self._push_adapter(received, adapter, version))
            self._version = version
            if self.engine_max_restarts:
                self._kept_adapter = (received, adapter)
            return paused

    def _push_adapter(self, received: dict[str, torch.Tensor], adapter: AdapterSpec, version: int) -> float:
        group = self._group or self._open_group()
        try:
            for chunk in gloo_transport.chunks(received.items(), self.chunk_bytes):
                manifest = gloo_transport.ChunkManifest.of(chunk).to_dict()
                # Returns at once: a thread of the worker receives the chunk while the engine goes on generating.
                self._rpc("lightning_rl_stage", update_info=manifest)
                gloo_transport.send_chunk(group, chunk)
        except gloo_transport.WeightTransferError:
            self._group = None  # a broken collective: the next push opens a fresh group
            raise
        folder = self._rpc("lightning_rl_write_adapter", config=adapter.config)
        self._adapter_loaded = False  # until this version is loaded
        started = time.perf_counter()
        self._post(f"pause?mode={self.pause}")
        try:
            self._post("v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": folder, "load_inplace": True})
            self._post("update_weight_version", {"new_version": str(version)})
        finally:
            self._resume()  # drops the prefix cache, whose keys and values the previous adapter computed
        paused = time.perf_counter() - started
        if self.verify_weights:
            verify_adapter(received, self._rpc("lightning_rl_held_adapter", lora_id=1, rank=adapter.rank), adapter, version)
        self._adapter_loaded = True
        return paused

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        """`method` of the server's worker extension (`vllm_gloo_backend.WeightSyncWorker`), on its one worker."""
        return self._post("collective_rpc", {"method": method, "kwargs": kwargs})["results"][0]

    def _model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._rpc("lightning_rl_model_info")
        return self._info

    @property
    def context_length(self) -> int | None:  # type: ignore[override]
        if self._context is None:
            self._context = (self._server_config().get("model_config") or {}).get("max_model_len")
        return self._context

    def _server_config(self) -> dict[str, Any]:
        return request_json(f"{self.url}/server_info?config_format=json", None, self.request_timeout, "GET")["vllm_config"]

    def _model_source(self) -> str:
        """This engine's model, else the one the server loaded."""
        return str(self.model) if self.model is not None else self._server_config()["model_config"]["model"]

    def _healing(self, action: Callable[[], T]) -> T:
        """`action()`, done again on a restarted server each time the server dies under it."""
        while True:
            life = self._lives
            try:
                return action()
            except VLLMServerError as error:
                self._recover(life, error)

    def _recover(self, life: int, error: VLLMServerError) -> None:
        """After `error` in the server's life `life`: return once a server that died is running again (restarted here,
        or by another request meanwhile) with the last weights pushed; raise what is not a death."""
        with self._lock:
            if self._lives != life:
                return
            if isinstance(error, EngineFailedError):
                raise error
            if isinstance(error, VLLMServerTimeout):
                raise self._failed(f"left a request unanswered for request_timeout={self.request_timeout:g} s (hung?)") from error
            if self.server is None or self._serving():
                raise error
            while self.restarts < self.engine_max_restarts:
                self.restarts += 1
                log.warning("the vLLM server at %s died (%s); restarting it (%d of engine_max_restarts=%d)", self.url,
                            error, self.restarts, self.engine_max_restarts)
                self._group = self._nccl = None  # their peer is gone: the next push opens a fresh group
                try:
                    self.server.restart()
                    self._lives += 1
                    if self._kept is not None:
                        self._push_verified(iter(self._kept.items()), self._version)
                    if self._kept_adapter is not None:
                        self._push_adapter(*self._kept_adapter, self._version)
                    return
                except VLLMServerError as again:  # it would not start, or died again while being re-synced
                    error = again
            raise self._failed(f"died ({error}) after {self.restarts} restarts (engine_max_restarts={self.engine_max_restarts})") from error

    def _serving(self) -> bool:
        """Whether the server still runs and answers ``/health`` (a request may fail on a server that is dying)."""
        if not self.server.alive:
            return False
        try:
            request_json(f"{self.url}/health", None, 10, "GET")
        except VLLMServerError:
            return False
        return True

    def _failed(self, what: str) -> EngineFailedError:
        server = f"the vLLM server at {self.url}" + (f" (pid {self.server.pid})" if self.server is not None else "")
        tail = " | ".join(line[:300] for line in self.server.log_tail()) if self.server is not None else ""
        return EngineFailedError(f"{server} {what}; its last log lines: {tail or '(none)'}")

    def _held(self) -> dict[str, Any]:
        """The server worker's `held_weights`: ``{"tensors": {name: [dtype, digest]}, "ties": {tied: source}}``."""
        workers = self._post("collective_rpc", {"method": "lightning_rl_held_weights"})["results"]
        if len(workers) != 1:
            raise VLLMServerError(f"verify_weights: the server splits the model over {len(workers)} workers; the check "
                                  "reads whole tensors from one (tensor_parallel_size 1), or set verify_weights: false")
        return workers[0]

    def _push_gloo(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                   changes: Mapping[str, SparseChange] | None = None) -> float:
        group = self._group or self._open_group()
        chunks = self._chunks(named_tensors, changes)
        try:
            if self.stage_weights:  # received on the server while it generates; the pause only loads them
                for chunk, manifest in chunks:
                    self._rpc("lightning_rl_stage", update_info=manifest)
                    gloo_transport.send_chunk(group, chunk)
            started = time.perf_counter()
            self._post(f"pause?mode={self.pause}")
            try:
                self._post("start_weight_update")
                if self.stage_weights:
                    self._post("update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": [], "staged": True}})
                for chunk, manifest in () if self.stage_weights else chunks:
                    self._while_posting("update_weights", {"update_info": manifest},
                                        lambda: gloo_transport.send_chunk(group, chunk))
                self._post("finish_weight_update", {"weight_version": str(version)})
            finally:
                self._resume()
        except gloo_transport.WeightTransferError:
            self._group = None  # a broken collective: the next push opens a fresh group
            raise
        return time.perf_counter() - started

    def _chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]], changes: Mapping[str, SparseChange] | None
                ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]]:
        """The push's chunks and their manifests: a delta's changed elements in place of their tensors (``changes``;
        None: every weight is sent, and the copies the worker kept before are dropped)."""
        stream = gloo_transport.encode_changes(named_tensors, {} if changes is None else changes)
        for count, chunk in enumerate(gloo_transport.chunks(stream, self.chunk_bytes)):
            yield chunk, gloo_transport.ChunkManifest.of(chunk, keep=self._keep_sent, reset=changes is None and count == 0).to_dict()

    def _push_nccl(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        sender = self._nccl or self._open_nccl()
        tensors = sender.round(named_tensors)  # gathered and checked while the server still generates
        started = time.perf_counter()
        self._post(f"pause?mode={self.pause}")
        try:
            sender.send(tensors, version)
        except BaseException:
            self._nccl = None  # a round that failed once started leaves the group unusable: the next push opens one
            raise
        finally:
            self._resume()
        return time.perf_counter() - started

    def _resume(self) -> None:
        if self.pause == "keep":
            # The frozen requests lose their KV cache (they are preempted, and recomputed under the new weights when
            # they run again) and so does the prefix cache: no token after the update is sampled from old keys/values.
            self._post("reset_prefix_cache?reset_running_requests=true")
        self._post("resume")

    def _while_posting(self, route: str, body: Any, action: Callable[[], T]) -> T:
        """Post `route` from a side thread while `action()` runs the collective the server waits in."""
        reply = self._control.submit(self._post, route, body)
        try:
            result = action()
        except RuntimeError as err:
            # A server that refused the request stopped taking part: its answer is the real cause.
            if reply.done() and reply.exception() is not None:
                raise VLLMServerError(f"{route}: {reply.exception()}") from err
            raise
        reply.result()
        return result

    def _transfer_world_size(self) -> int:
        """This trainer (rank 0) and the server's workers."""
        return 1 + int(request_json(f"{self.url}/get_world_size", None, self.request_timeout, "GET")["world_size"])

    def _open_nccl(self) -> NCCLSender:
        from lightning_rl.rollout.nccl_transport import NCCLSender  # imports vLLM: only for this transport

        device = torch.device("cuda", torch.cuda.current_device())
        self._nccl = NCCLSender(self._post, self.model, address=self.transfer_address,
                                world_size=self._transfer_world_size(), device=device, buffer_bytes=self.chunk_bytes,
                                held_aliases=set(self._model_info()["held_aliases"]))
        return self._nccl

    def _open_group(self) -> torch.distributed.ProcessGroupGloo:
        world_size = self._transfer_world_size()
        store = gloo_transport.host_store(self.transfer_address, world_size, self.transfer_timeout)
        init_info = {"master_address": self.transfer_address, "master_port": store.port, "world_size": world_size,
                     "rank_offset": 1, "timeout_s": self.transfer_timeout.total_seconds()}
        self._group = self._while_posting(
            "init_weight_transfer_engine", {"init_info": init_info},
            lambda: gloo_transport.join_group(store, 0, world_size, self.transfer_timeout),
        )
        return self._group

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
        if self._group is not None or self._nccl is not None:
            self._group = self._nccl = None
            try:
                self._post("shutdown_weight_transfer_engine", timeout=30)
            except VLLMServerError:
                pass  # the server is already gone, and with it what the group held there
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False)
        if self._stop_server is not None:
            self._stop_server()
