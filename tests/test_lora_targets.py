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
