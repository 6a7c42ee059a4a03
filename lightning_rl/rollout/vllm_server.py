"""A rollout engine that talks to a separate `vllm serve` process over HTTP.

Generation goes through vLLM's token-in/token-out route (`/inference/v1/generate`), which also
reports the weight version each token was sampled with. Weights go through vLLM's weight-transfer
routes: the server is paused (in-flight requests finish on the old weights), each chunk's manifest is
posted while its bytes are broadcast over the transfer group, and the update is committed under the
new version before generation resumes. On this CPU build the transfer group is gloo
(`gloo_transport`, served by `vllm_gloo_backend`).

The trainer side needs only torch and the standard library: vLLM may live in another environment.
`VLLMServer` starts and stops a server process for a single-machine run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_rl.rollout import gloo_transport
from lightning_rl.rollout.base import Rollout, RolloutBatch, SamplingConfig
from lightning_rl.rollout.vllm_engine import sampling_params_of


T = TypeVar("T")


class VLLMServerError(RuntimeError):
    """The server refused a request or could not be reached; the message carries its answer."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _request(url: str, body: Any | None, timeout: float, method: str = "POST") -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
    except urllib.error.HTTPError as err:
        raise VLLMServerError(f"{method} {url}: HTTP {err.code}: {err.read().decode(errors='replace')[:2000]}") from err
    except (urllib.error.URLError, OSError) as err:
        raise VLLMServerError(f"{method} {url}: {err}") from err
    return json.loads(payload) if payload else None


class VLLMServer:
    """A `vllm serve` subprocess on loopback, configured for rollouts and gloo weight pushes.

    The process runs in its own process group and is stopped by its PID (`stop`, or leaving the
    `with` block). `python` is the interpreter of an environment with vLLM and lightning-rl installed
    (the server imports `vllm_gloo_backend`); it may differ from the trainer's.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        python: str | os.PathLike = sys.executable,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", host, "--port", str(self.port),
            "--dtype", dtype, "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out",  # mounts the token-in/token-out /inference/v1/generate route
            "--weight-transfer-config", json.dumps({"backend": "gloo"}),
            # Importing this class in the server's workers registers the gloo backend there.
            "--worker-extension-cls", "lightning_rl.rollout.vllm_gloo_backend.GlooWeightTransferWorker",
        ]
        if max_model_len is not None:
            self.command += ["--max-model-len", str(max_model_len)]
        if kv_cache_memory_bytes is not None:
            self.command += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        if enforce_eager:
            self.command.append("--enforce-eager")
        self.command += list(extra_args)
        # The weight-transfer and pause routes are only mounted in vLLM's development mode.
        self.env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float = 300.0) -> VLLMServer:
        """Launch the server and wait until `/health` answers (or the process dies, with its log tail)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        finally:
            if self.log_path is not None:
                log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"vLLM server exited with code {self.process.returncode}{self._log_tail()}")
            try:
                _request(f"{self.url}/health", None, timeout=5, method="GET")
                return self
            except VLLMServerError:
                time.sleep(0.5)
        self.stop()
        raise VLLMServerError(f"vLLM server did not answer /health within {timeout:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return ":\n" + self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group by PID, SIGKILL what is left after `timeout`; returns once none is left."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # Engine and worker processes can outlive the server itself by a moment.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.process.poll()  # reaps the server once it has exited, so it no longer counts as left
            if not self._kill_group():
                break
            time.sleep(0.1)

    def _kill_group(self) -> bool:
        """SIGKILL the server's process group; False once no process of it is left."""
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def __enter__(self) -> VLLMServer:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VLLMServerEngine:
    """`RolloutEngine` over a vLLM server: the one at `url`, or without it one started here for `model`.

    A server started here (with `server_options` for `VLLMServer`) is stopped by `close`. A server
    given by `url` must run with the flags `VLLMServer` passes. `transfer_address` is the address
    of this (trainer) machine as the server reaches it; the transfer group opens on the first
    `push_weights`. Chunks of about `chunk_bytes` bound the memory a push holds at once.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        url: str | None = None,
        seed: int = 0,
        server_options: Mapping[str, Any] | None = None,
        transfer_address: str = "127.0.0.1",
        chunk_bytes: int = gloo_transport.DEFAULT_CHUNK_BYTES,
        request_timeout: float = 600.0,
        transfer_timeout: float = 300.0,
        max_concurrent_requests: int = 64,
    ) -> None:
        if url is None and model is None:
            raise ValueError("VLLMServerEngine needs the url of a running server or a model to start one for")
        self.server = VLLMServer(model, seed=seed, **dict(server_options or {})).start() if url is None else None
        # A server started here must not outlive this process, even if close is never called.
        self._stop_server = weakref.finalize(self, self.server.stop) if self.server is not None else None
        self.url = (url or self.server.url).rstrip("/")
        self.seed = seed
        self.transfer_address = transfer_address
        self.chunk_bytes = chunk_bytes
        self.request_timeout = request_timeout
        self.transfer_timeout = timedelta(seconds=transfer_timeout)
        self._pool = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="vllm-generate")
        # Weight-transfer posts get their own thread: generate requests held by a paused server must not starve them.
        self._control = ThreadPoolExecutor(1, thread_name_prefix="vllm-weights")
        self._group: torch.distributed.ProcessGroupGloo | None = None
        self._version = 0
        self._calls = 0
        self._lock = threading.Lock()

    def _post(self, route: str, body: Any | None = None, timeout: float | None = None) -> Any:
        return _request(f"{self.url}/{route}", body, timeout or self.request_timeout)

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingConfig) -> RolloutBatch:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        with self._lock:
            seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
            self._calls += 1
        # vLLM seeds sample k of a request with seed + k: spacing prompts n apart keeps all samples distinct.
        requests = [
            self._pool.submit(self._post, "inference/v1/generate", {
                "token_ids": list(prompt), "sampling_params": sampling_params_of(sampling, n, seed + g * n), "output_mode": "tokens",
            })
            for g, prompt in enumerate(prompts)
        ]
        return RolloutBatch([self._group_of(g, list(prompt), request.result()) for g, (prompt, request)
                             in enumerate(zip(prompts, requests))])

    def _group_of(self, group_id: int, prompt: list[int], response: dict[str, Any]) -> list[Rollout]:
        rollouts = []
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            # Spans carry the version committed by `push_weights`; before the first push the server has none.
            spans = [span for span in choice.get("weight_versions") or [] if str(span.get("version")).isdigit()]
            # The oldest weights that produced any token of the completion bound its staleness.
            version = min((int(span["version"]) for span in spans), default=self._version)
            rollouts.append(Rollout(
                prompt_ids=prompt,
                completion_ids=list(choice["token_ids"]),
                logprobs=[entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []],
                weight_version=version,
                group_id=group_id,
                finish_reason=choice.get("finish_reason") or "length",
                metadata={"weight_versions": spans} if len(spans) > 1 else {},
            ))
        return rollouts

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with self._lock:
            group = self._group or self._open_group()
            self._post("pause?mode=wait")
            try:
                self._post("start_weight_update")
                for chunk in gloo_transport.chunks(named_tensors, self.chunk_bytes):
                    manifest = gloo_transport.ChunkManifest.of(chunk).to_dict()
                    self._while_posting("update_weights", {"update_info": manifest},
                                        lambda: gloo_transport.send_chunk(group, chunk))
                self._post("finish_weight_update", {"weight_version": str(version)})
            finally:
                self._post("resume")
            self._version = version

    def _while_posting(self, route: str, body: Any, action: Callable[[], T]) -> T:
        """Post `route` from a helper thread while `action()` runs the collective the server waits in."""
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

    def _open_group(self) -> torch.distributed.ProcessGroupGloo:
        world_size = 1 + int(_request(f"{self.url}/get_world_size", None, self.request_timeout, "GET")["world_size"])
        store = gloo_transport.host_store(self.transfer_address, world_size, self.transfer_timeout)
        init_info = {"master_address": self.transfer_address, "master_port": store.port, "world_size": world_size,
                     "rank_offset": 1, "timeout_s": self.transfer_timeout.total_seconds()}
        self._group = self._while_posting(
            "init_weight_transfer_engine", {"init_info": init_info},
            lambda: gloo_transport.join_group(store, 0, world_size, self.transfer_timeout),
        )
        return self._group

    def close(self) -> None:
        if self._group is not None:
            self._group = None
            try:
                self._post("shutdown_weight_transfer_engine", timeout=30)
            except VLLMServerError:
                pass  # the server is already gone, and with it what the group held there
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._control.shutdown(wait=False)
        if self._stop_server is not None:
            self._stop_server()
