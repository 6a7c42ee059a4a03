"""LoRA targets that name no module are refused in one line that says what the model has instead: its linear
layers, and for a mixture of experts whose projections are fused 3-D parameters, that those are not adapted."""

import pytest
from support import tiny_moe

from lightning_rl.errors import RecipeError
from lightning_rl.models.loading import _check_lora_targets


def test_fused_expert_projections_are_named_in_the_refusal():
    model = tiny_moe.build("qwen3_moe")
    _check_lora_targets(model, ["q_proj", "v_proj"])  # attention modules exist: nothing to refuse
    with pytest.raises(RecipeError, match=r"'gate_proj', 'down_proj' match no module of Qwen3MoeForCausalLM \(its linear layers: .*"
                                          r"q_proj.*; or all-linear; its experts' projections are fused parameters \(down_proj, gate_up_proj\)"):
        _check_lora_targets(model, ["q_proj", "gate_proj", "down_proj"])


def test_the_output_head_and_a_container_module_are_refused_naming_the_key_and_the_linear_layers():
    """An adapted head was refused at the first step as a packing problem, with a hint (packing: none) that failed the
    same way; peft's refusal of a container module was cut off inside the module's repr."""
    from lightning_rl.models.loading import LoraSettings, load_causal_lm

    for targets in (["q_proj", "lm_head"], "lm_head"):
        with pytest.raises(RecipeError, match=r"^lora.target_modules: 'lm_head' is Qwen3ForCausalLM's output head \(lm_head\), whose "
                                              r"log-probs are computed in chunks from its plain weight: leave it out \(all-linear does\)$"):
            load_causal_lm("tiny", lora=LoraSettings.checked({"r": 2, "target_modules": targets}))
    with pytest.raises(RecipeError, match=r"^lora.target_modules: peft cannot adapt Qwen3ForCausalLM as asked: Target module Qwen3MLP is "
                                          r"not supported \(name the modules to adapt: its linear layers down_proj, gate_proj, .*; or all-linear\)$"):
        load_causal_lm("tiny", lora=LoraSettings(r=2, target_modules=["mlp"]))
    with pytest.raises(RecipeError, match=r"\(its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; or all-linear\)$"):
        load_causal_lm("tiny", lora=LoraSettings(r=2, target_modules=["qkv"]))  # the head, refused when named, is not offered


def test_dropout_on_a_mixture_of_experts_expert_weights_is_refused_naming_lora_dropout():
    """peft adapts fused expert weights (parameters, not layers) only without dropout: its refusal was blamed on
    lora.target_modules, with "all-linear" (what was given) as the fix and linear layers read off the half-adapted
    model ("base_layer, default")."""
    from lightning_rl.models.loading import with_adapters
    from peft import LoraConfig

    with pytest.raises(RecipeError, match=r"^lora.dropout: peft cannot adapt Qwen3MoeForCausalLM as asked with dropout 0.1: .*lora_dropout.*"
                                          r"\(set lora.dropout: 0, or name in lora.target_modules only linear layers: k_proj, .*q_proj, v_proj\)$") as refused:
        with_adapters(tiny_moe.build("qwen3_moe"), LoraConfig(r=2, lora_dropout=0.1, target_modules="all-linear"))
    assert refused.value.key == "lora.dropout" and "base_layer" not in str(refused.value)


def test_a_16_bit_merged_export_rounds_each_weight_once(tiny_path, tmp_path, tiny_tokenizer):
    """peft adds the adapter's product, rounded to bfloat16, to a bfloat16 weight and rounds the sum again; the export
    merges in float32 and rounds once, to the weight the exact merge rounds to."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_rl.models.loading import export_hf

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.to(torch.bfloat16)  # as trainer.precision bf16-true holds it: the adapters in bfloat16 too
    layers = {name: m for name, m in model.named_modules() if name.endswith("q_proj") and hasattr(m, "lora_B")}
    exact = {}
    for name, layer in layers.items():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
        delta = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double() * layer.scaling["default"]
        exact[name.removeprefix("base_model.model.") + ".weight"] = (layer.base_layer.weight.double() + delta).to(torch.bfloat16)
    export_hf(model, tiny_tokenizer, tmp_path / "hf", mode="merged")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert exact and all(saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], weight) for name, weight in exact.items())


def test_an_adapter_exported_from_a_base_under_home_loads_with_its_base(tiny_path, tmp_path, tiny_tokenizer, monkeypatch):
    """A recipe's ``~/...`` model is written as the folder it names: from_pretrained does not expand ``~``."""
    import shutil

    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_rl.models.loading import export_hf

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_path, tmp_path / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(r=2, target_modules=["q_proj"]))
    export_hf(model, tiny_tokenizer, tmp_path / "hf", mode="adapter", base_model="~/base")
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.peft_config["default"].base_model_name_or_path == str(tmp_path / "base")
