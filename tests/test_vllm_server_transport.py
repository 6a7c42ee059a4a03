"""Which weight transport the vLLM server engine picks, and the server command line for each.

Nothing here starts a server or needs vLLM or a GPU, so it runs in either environment. The NCCL payloads are
checked against vLLM's own dataclasses in `vllm_engines/test_vllm_server_nccl.py` (in `.venv-vllm`).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from lightning_rl.rollout.vllm_server import VLLMServerEngine, resolve_transport
from lightning_rl.rollout.vllm_server_process import VLLMServer, vllm_on_cpu

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_CUDA = torch.cuda.is_available()


def test_auto_is_nccl_only_where_cuda_and_vllm_both_are():
    assert resolve_transport("auto") == ("nccl" if HAS_CUDA and HAS_VLLM else "gloo")
    assert resolve_transport("gloo") == "gloo"


def test_an_unknown_transport_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"^transport must be one of auto, gloo, nccl; got 'mpi'$"):
        resolve_transport("mpi")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable in this environment")
def test_nccl_without_vllm_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^transport 'nccl' needs vLLM in the trainer's environment") as err:
        resolve_transport("nccl")
    assert "\n" not in str(err.value) and str(err.value).endswith("use transport 'gloo'")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is importable in this environment")
def test_an_engine_asked_for_nccl_without_vllm_starts_no_server():
    # The refusal comes before VLLMServer is built: no process is started for a run that cannot push.
    with pytest.raises(ValueError, match=r"^transport 'nccl' needs vLLM"):
        VLLMServerEngine("no/such/model", transport="nccl")


def test_a_running_servers_backend_decides_auto_and_must_match_a_choice():
    assert resolve_transport("auto", server_backend="gloo") == "gloo"
    assert resolve_transport("gloo", server_backend="gloo") == "gloo"
    with pytest.raises(ValueError, match=r"^transport 'gloo' asked for, but the server runs the 'nccl' backend$"):
        resolve_transport("gloo", server_backend="nccl")
    if not (HAS_CUDA and HAS_VLLM):
        # An NCCL server is no use to a trainer that cannot send over NCCL: said now, not at the first push.
        with pytest.raises(ValueError, match=r"^transport 'nccl' needs "):
            resolve_transport("auto", server_backend="nccl")


def server_command(transport: str, on_cpu: bool = False) -> list[str]:
    return VLLMServer("some/model", port=8123, python="python", seed=3, transport=transport, on_cpu=on_cpu).command


COMMON = [
    "python", "-m", "vllm.entrypoints.openai.api_server",
    "--model", "some/model", "--host", "127.0.0.1", "--port", "8123",
    "--dtype", "auto", "--seed", "3",
    "--logprobs-mode", "processed_logprobs",
    "--max-logprobs", "-1",
    "--enable-scale-out",
]  # fmt: skip


EXTENSION = ["--worker-extension-cls", "lightning_rl.rollout.vllm_gloo_backend.WeightSyncWorker"]


def test_a_gloo_server_loads_our_backend_through_the_worker_extension():
    assert server_command("gloo") == [*COMMON, "--weight-transfer-config", '{"backend": "gloo"}', *EXTENSION]


def test_a_cpu_server_prefills_each_prompt_in_one_step():
    # vLLM's CPU build dies when it splits a seeded request's prefill; by default the machine running vLLM decides.
    # It takes a share of the host's memory the trainer beside it leaves free: vLLM's own default (92%) never starts.
    assert server_command("gloo", on_cpu=True) == [*COMMON, "--weight-transfer-config", '{"backend": "gloo"}', *EXTENSION,
                                                          "--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.3"]  # fmt: skip
    default = VLLMServer("some/model", python="python", transport="gloo").command
    assert ("--no-enable-chunked-prefill" in default) is vllm_on_cpu() and ("--gpu-memory-utilization" in default) is vllm_on_cpu()


def test_a_cpu_servers_memory_is_the_recipes_where_it_gives_it():
    def memory_flags(**options):
        command = VLLMServer("some/model", python="python", on_cpu=True, **options).command
        return [arg for i, arg in enumerate(command) if "memory" in arg or (i and "memory" in command[i - 1])]

    assert memory_flags(kv_cache_memory_bytes=2**20) == ["--kv-cache-memory-bytes", "1048576"]
    assert memory_flags(gpu_memory_utilization=0.5) == ["--gpu-memory-utilization", "0.5"]
    assert memory_flags(extra_args=["--gpu-memory-utilization=0.6"]) == ["--gpu-memory-utilization=0.6"]
    # Chunked prefill turned off on a GPU leaves the GPU's share to vLLM.
    gpu = VLLMServer("some/model", python="python", on_cpu=False, whole_prefills=True).command
    assert "--no-enable-chunked-prefill" in gpu and "--gpu-memory-utilization" not in gpu
    with pytest.raises(ValueError, match="extra_args --gpu-memory-utilization: the engine starts the server with its own"):
        VLLMServer("some/model", python="python", gpu_memory_utilization=0.5, extra_args=["--gpu-memory-utilization", "0.6"])


def test_an_nccl_server_runs_vllms_own_backend_with_our_extension_for_verification():
    # The extension's read-back of the held weights is what verifies a push over either transport.
    command = server_command("nccl")
    assert command == [*COMMON, "--weight-transfer-config", '{"backend": "nccl"}', *EXTENSION]
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}


def test_the_server_takes_a_resolved_backend_only():
    # "auto" is the engine's to resolve (it knows the trainer's side); a server started alone names its backend.
    with pytest.raises(ValueError, match=r"^transport must be one of gloo, nccl; got 'auto'$"):
        VLLMServer("some/model", transport="auto", python=sys.executable)


def test_a_server_that_fails_to_start_is_reported_by_its_first_error(tmp_path):
    """vLLM's last lines only say its engine failed to start; the cause is the first error its workers logged."""
    log = tmp_path / "server.log"
    lines = ["INFO starting", "(EngineCore pid=7) ValueError: Available memory on node 0 (20.91/23.54 GiB) is less than desired",
             *[f"  File 'frame{i}.py', line {i}" for i in range(60)], "RuntimeError: Engine core initialization failed. See root cause above."]  # fmt: skip
    log.write_text("\n".join(lines) + "\n")
    said = VLLMServer("no/such/model", log_path=log)._log_tail()
    assert said.startswith(": ValueError: Available memory on node 0 (20.91/23.54 GiB) is less than desired:\n")
    assert said.rstrip().endswith("Engine core initialization failed. See root cause above.")


def test_a_server_that_cannot_start_or_answer_is_one_line_before_anything_runs(tiny_path):
    """A port another process holds is refused before vLLM starts (whatever answered /health there was taken for this
    server, and sampled from); a url that does not answer, and a dtype vLLM does not know, are one line too."""
    import socket

    from lightning_rl.errors import UserError
    from lightning_rl.rollout.base import EngineSpec

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(UserError, match=rf"^the vLLM server did not start: port {port} on 127.0.0.1 is taken by another process"):
            VLLMServerEngine(str(tiny_path), server_options={"port": port, "python": sys.executable})
    with pytest.raises(UserError, match=r"^url: the vLLM server at http://127.0.0.1:1 does not answer \("):
        VLLMServerEngine(str(tiny_path), url="http://127.0.0.1:1")
    engine = {"class_path": "lightning_rl.rollout.vllm_server.VLLMServerEngine", "init_args": {"server_options": {"dtype": "float13", "python": sys.executable}}}
    with pytest.raises(ValueError, match="server_options.dtype: must be one of auto, half"):
        EngineSpec.of(engine).check_here()


def test_a_server_that_does_not_start_is_said_by_its_root_cause():
    """The first error-like text of the log was taken, a warning's included: on a machine with a low file limit every
    start failure was said to be 'Too many open files', and argparse's refusal of a flag was never found."""
    from lightning_rl.rollout.vllm_server_process import first_error

    warning = ("(APIServer pid=7) WARNING 12-05 07:00:01 [system_utils.py:90] Found ulimit of 20000 and failed to raise "
               "it: OSError: [Errno 24] Too many open files")  # fmt: skip
    validation = [warning, "(APIServer pid=7) Traceback (most recent call last):", '  File "api_server.py", line 1, in <module>',
                  "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                  "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len (1024)",
                  "RuntimeError: Engine core initialization failed. See root cause above."]  # fmt: skip
    assert first_error("\n".join(validation)) == (
        "ValidationError: 1 validation error for ModelConfig Value error, User-specified max_model_len (100000) is greater "
        "than the derived max_model_len (1024)")
    usage = [warning, "usage: api_server.py [-h] [--host HOST]", "api_server.py: error: unrecognized arguments: --bogus-flag"]
    assert first_error("\n".join(usage)) == "api_server.py: error: unrecognized arguments: --bogus-flag"
    assert first_error(warning) is None
