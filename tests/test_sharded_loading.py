"""Weights loaded straight into FSDP2 shards equal a plain from_pretrained, and no rank reads the whole model."""


from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_rl.models.loading import LoraSettings, load_causal_lm
from lightning_rl.models.sharded_loading import CheckpointMismatchError, load_deferred_weights, pending_checkpoint
from lightning_rl.models.weights import hf_name
from support.recipe_runs import checkpoint_elements, run_tiny_muse, run_with_check


@pytest.mark.parametrize("case", ["muse_lora", "qwen3_full"])
def test_two_ranks_each_read_their_half(case, tiny_muse_path, tiny_path, tmp_path):
    base, extra = (tiny_muse_path, ()) if case == "muse_lora" else (tiny_path, ("--model.lora=null",))
    result = run_with_check(base, tmp_path, *extra)
    diff = result["diff"]
    assert diff["compared"] > 0 and diff["differ"] == [] and diff["missing"] == [], diff
    if case == "muse_lora":
        assert diff["lora_A"] > 0 and diff["lora_A_zero"] == []  # adapters initialised, not left empty
    total = checkpoint_elements(base)
    reads = [report["elements_read"] for (report,) in result["ranks"]]
    # Each rank reads its half of every sharded tensor, plus the small replicated buffers; never the whole model.
    assert all(0.4 * total < r < 0.6 * total for r in reads), (reads, total)
    assert sum(reads) < 1.1 * total


@pytest.mark.parametrize("case", ["muse_lora", "vlm"])
def test_one_process_deferred_load_equals_from_pretrained(tiny_muse_path, case):
    """The image-text model's checkpoint holds LLaVA's names (``vision_tower.*``), which transformers renames as it
    loads (``model.vision_tower.*``): the deferred load finds them the same way. The LoRA factors, which no
    checkpoint holds, are drawn as a whole load on one process draws them from the same seed: a run sharded over
    ranks starts from the adapters a run on one process does."""
    from lightning_rl.models.paths import resolve_model_path

    path = tiny_muse_path if case == "muse_lora" else Path(resolve_model_path("tiny-vlm"))
    lora = LoraSettings(target_modules=["q_proj", "v_proj", "embed_tokens"])
    model = load_causal_lm(str(path), lora=lora, defer_weights=True)
    assert pending_checkpoint(model) is not None and all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    report = load_deferred_weights(model, seed=7)
    assert report.elements_read == checkpoint_elements(path) and pending_checkpoint(model) is None
    torch.manual_seed(7)
    whole = load_causal_lm(str(path), lora=lora).get_base_model()
    reference = load_causal_lm(str(path))
    base = model.get_base_model()
    got = {hf_name(name): tensor for name, tensor in base.state_dict().items() if ".lora_" not in name}
    assert got.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    factors = {name: tensor for name, tensor in whole.state_dict().items() if ".lora_" in name}
    for drawn in (".lora_A.", ".lora_embedding_B."):  # the factors drawn at random (the others start at zero)
        assert any(drawn in name and tensor.abs().sum() > 0 for name, tensor in factors.items()), drawn
    for name, tensor in factors.items():
        torch.testing.assert_close(base.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    for (name, buffer), (_, want) in zip(base.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(buffer, want, rtol=0, atol=0, msg=name)  # rotary frequencies rebuilt


def test_a_checkpoint_that_does_not_fit_the_model_is_named(tiny_path, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for item in tiny_path.iterdir():
        (folder / item.name).symlink_to(item)
    weights = load_file(tiny_path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    (folder / "model.safetensors").unlink()
    save_file({**weights, name: weights[name][:-1].contiguous()}, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(str(folder), defer_weights=True).to_empty(device="cpu")
    with pytest.raises(CheckpointMismatchError, match=rf"model.safetensors: '{name}' has shape \(\d+, \d+\), the model expects"):
        load_deferred_weights(model)
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(str(folder), defer_weights=True).to_empty(device="cpu")
    with pytest.raises(CheckpointMismatchError, match=f"the checkpoint has no tensor '{name}'"):
        load_deferred_weights(model)
    # Through `lightning-rl run` on two FSDP2 ranks: one line naming the recipe key, the file and the tensor.
    done = run_tiny_muse(folder, tmp_path / "run", "--model.lora=null")
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"model.model_name_or_path: {folder}: the checkpoint has no tensor '{name}'" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "hf").exists()


def test_lora_factors_are_drawn_alike_whatever_the_default_dtype():
    """A precision plugin sets the default dtype (float64 at 64-true, bfloat16 at bf16-true) around one process's
    configure_model, where its LoRA factors are drawn, and not around a sharded load: the draws were other numbers
    there, so an FSDP2 run started from other LoRA factors than one process's, and a 64-true run than a 32-true one's."""
    from lightning_rl.models.sharded_loading import lora_factor

    name, shape = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", torch.Size([4, 32])
    drawn = lora_factor(name, shape, seed=0)
    for dtype in (torch.float64, torch.bfloat16):
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            assert torch.equal(lora_factor(name, shape, seed=0), drawn) and lora_factor(name, shape, 0).dtype == torch.float32
        finally:
            torch.set_default_dtype(before)
