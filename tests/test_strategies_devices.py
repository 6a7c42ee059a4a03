"""Device detection, ROCm choices, and strategies refused before training when the hardware cannot run them.

No ROCm torch, torch_xla or Neuron device can be installed here: those paths are exercised through
DeviceInventory inputs (what each machine would report), never on real hardware.
"""

from __future__ import annotations

import os
from unittest import mock

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightning_rl.strategies import FSDP2Strategy, ROCmFSDP2Strategy, StrategyUnavailableError, check_strategy_request
from lightning_rl.strategies.devices import detect_devices
from lightning_rl.models.structure import find_decoder_layers, find_model_roots
from lightning_rl.strategies.fsdp2 import mixed_precision_policy
from lightning_rl.strategies.rocm import engine_visible_devices
from support.machines import CPU, CUDA, NEURONX, ROCM  # the machines described for the env report


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_detection_on_this_machine_matches_torch() -> None:
    inventory = detect_devices()
    assert inventory.hip_version == torch.version.hip and inventory.cuda_version == torch.version.cuda
    assert inventory.gpu_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert not inventory.has_torch_xla and not inventory.has_native_neuron


def test_fsdp1_on_cpu_is_refused_in_one_line_naming_fsdp2() -> None:
    for request in [("fsdp", "cpu", CUDA), ("fsdp", None, CPU), ("fsdp_cpu_offload", "auto", CPU)]:
        with pytest.raises(StrategyUnavailableError) as error:
            check_strategy_request(*request)
        assert "FSDP1" in one_line(error) and "use strategy 'fsdp2'" in one_line(error)
    check_strategy_request("fsdp", "cuda", CUDA)
    check_strategy_request("fsdp2", "cpu", CPU)


def test_neuron_and_xla_without_runtime_are_refused_before_training() -> None:
    with pytest.raises(StrategyUnavailableError) as error:
        L.Trainer(strategy="neuron", logger=False)
    assert "no Neuron runtime" in one_line(error) and "torch-neuronx" in one_line(error)
    with pytest.raises(StrategyUnavailableError) as error:
        L.Trainer(strategy="xla_static", logger=False)
    assert "torch_xla is not installed" in one_line(error) and "use 'fsdp2'" in one_line(error)
    with pytest.raises(StrategyUnavailableError) as error:
        check_strategy_request("neuron", inventory=NEURONX)
    assert "use 'xla_static'" in one_line(error)
    # Lightning's own XLA names and its TPU accelerator were Lightning's ModuleNotFoundError (or TypeError) traceback.
    for strategy, accelerator, key in (("xla", None, "strategy"), ("single_xla", None, "strategy"), ("auto", "tpu", "accelerator")):
        with pytest.raises(StrategyUnavailableError, match=r"needs torch_xla, and torch_xla is not installed .*'xla_static' pads rows") as error:
            check_strategy_request(strategy, accelerator, inventory=CPU)
        assert error.value.key == f"trainer.{key}"  # the key the recipe set


def test_a_strategy_that_pickles_the_trainer_into_its_processes_is_refused() -> None:
    # ddp_spawn failed deep in Lightning's launcher (a local stop-signal handler cannot be pickled); ddp_fork works.
    for strategy in ("ddp_spawn", "ddp_spawn_find_unused_parameters_true"):
        with pytest.raises(StrategyUnavailableError, match=rf"^strategy '{strategy}' starts its processes by pickling the running trainer.*use 'ddp'"):
            check_strategy_request(strategy, "cpu", inventory=CPU)
    check_strategy_request("ddp_fork", "cpu", inventory=CPU)


def test_rocm_options_on_cuda_or_cpu_are_refused() -> None:
    with pytest.raises(StrategyUnavailableError) as error:
        ROCmFSDP2Strategy(inventory=CUDA)
    assert "CUDA 12.8 build" in one_line(error) and "use 'fsdp2' instead" in one_line(error)
    with pytest.raises(StrategyUnavailableError) as error:
        L.Trainer(strategy="fsdp2_rocm", logger=False)
    assert "torch.version.hip is None" in one_line(error)
    with pytest.raises(StrategyUnavailableError) as error:
        engine_visible_devices({"HIP_VISIBLE_DEVICES": "0"}, CUDA)
    assert "use CUDA_VISIBLE_DEVICES instead" in one_line(error)


def test_rocm_machine_gets_rccl_and_matching_visible_devices() -> None:
    """A mocked ROCm machine (no ROCm torch installs here): RCCL, and the engines' processes (which inherit this
    process's environment) see the GPUs the scheduler gave, under both variables. Before, the strategy computed the
    variables and dropped them."""
    with mock.patch.dict(os.environ, {}, clear=False):
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        strategy = ROCmFSDP2Strategy(inventory=ROCM)  # ROCM's environment: HIP_VISIBLE_DEVICES=0,...,7
        assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert strategy.process_group_backend == "nccl"  # the name RCCL answers to in a ROCm torch
    assert engine_visible_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, ROCM) == {
        "CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "2,3",
    }
    assert engine_visible_devices({"HIP_VISIBLE_DEVICES": "1"}, ROCM)["CUDA_VISIBLE_DEVICES"] == "1"
    assert engine_visible_devices({}, ROCM) == {}
    with pytest.raises(StrategyUnavailableError, match="disagree"):
        engine_visible_devices({"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}, ROCM)


def test_fsdp2_registered_and_configurable_by_name() -> None:
    trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)
    policy = mixed_precision_policy("bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy(None).param_dtype is None
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        mixed_precision_policy("int8")


def tiny_models() -> list[torch.nn.Module]:
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16)
    return [LlamaForCausalLM(LlamaConfig(**common)), Qwen3ForCausalLM(Qwen3Config(**common))]


def test_decoder_layers_found_generically() -> None:
    for model in tiny_models():
        layers = find_decoder_layers(model)
        assert layers == list(model.model.layers)
        peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
        assert len(find_decoder_layers(peft_model)) == 3
        assert find_model_roots(peft_model) == [peft_model]

    class PolicyAndReference(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.policy, self.reference = tiny_models()

    module = PolicyAndReference()
    assert find_model_roots(module) == [module.policy, module.reference]
    assert len(find_decoder_layers(module, layer_classes=["LlamaDecoderLayer"])) == 3


def test_sharding_refuses_parameters_it_could_not_reduce() -> None:
    class WithValueHead(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_models()[0]
            self.value_head = torch.nn.Parameter(torch.zeros(32))

    with pytest.raises(TypeError) as error:
        FSDP2Strategy().shard(WithValueHead())
    assert "parameter 'value_head' lies outside every transformers model" in one_line(error)

    with pytest.raises(TypeError, match="found no transformers model"):
        FSDP2Strategy().shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_sharding_refuses_a_block_shared_across_layers() -> None:
    """A block a model reuses in several layers (Zamba's shared transformer) is a parameter two units own: the second
    fully_shard found it a DTensor already, and the forward failed on tensors and DTensors mixed."""
    from lightning_rl.errors import RecipeError

    class Policy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_models()[0]
            self.model.model.layers[2].mlp = self.model.model.layers[0].mlp

    with pytest.raises(RecipeError, match=r"^trainer.strategy: LlamaForCausalLM uses parameter 'mlp.gate_proj.weight' in both model.layers.0 "
                                          r"and model.layers.2 \(a block shared across layers\), which FSDP2 cannot shard layer by layer: "):
        FSDP2Strategy().shard(Policy())


def test_layer_classes_that_name_no_module_and_a_data_parallel_size_not_the_worlds_are_one_line() -> None:
    """A misspelt layer class left every layer unsharded (the model one unit, gathered whole) without a word; a
    data_parallel_size other than the world's was Lightning's traceback on every rank."""
    from lightning_rl.errors import RecipeError

    class Policy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_models()[0]

    with pytest.raises(RecipeError, match=r"^trainer.strategy.layer_classes: Nope is no module class of the model, whose layers "
                                          r"would go unsharded \(its repeated blocks: LlamaDecoderLayer\)$"):
        FSDP2Strategy(layer_classes=["Nope", "LlamaDecoderLayer"]).shard(Policy())
    assert FSDP2Strategy(layer_classes="LlamaDecoderLayer").layer_classes == ("LlamaDecoderLayer",)  # one name, not its letters
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(data_parallel_size=2), logger=False)
    with pytest.raises(RecipeError, match=r"^trainer.strategy.data_parallel_size=2, but the run has 1 processes .*: give auto$"):
        trainer.strategy.setup_environment()


def test_neuron_devices_are_read_as_lightning_reads_devices(monkeypatch) -> None:
    """Mocked device count (no Neuron device here). ``devices=-1`` was no device at all, and ``"2"`` the device of
    index 2 where Lightning reads two devices."""
    from lightning_rl.strategies.xla import NeuronAccelerator

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    read = {str(given): NeuronAccelerator.parse_devices(given) for given in (-1, "-1", "auto", 2, "2", "1,3", [0, 2], "0,")}
    assert read == {"-1": [0, 1, 2, 3], "auto": [0, 1, 2, 3], "2": [0, 1], "1,3": [1, 3], "[0, 2]": [0, 2], "0,": [0]}
    # Lightning's Accelerator is abstract in its name too: the class could not be built, so `neuron` failed on Neuron.
    accelerator = NeuronAccelerator()
    assert accelerator.name() == "neuron" and accelerator.auto_device_count() == 4  # torch here knows no "neuron" device
