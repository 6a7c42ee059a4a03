"""Packed SFT rows on the real tiny model: packed log-probs equal separate runs, and examples never see
each other (changing one leaves the others' log-probs untouched)."""

import json

import pytest
import torch

from support.paths import TOY_TRAIN
from lightning_rl.data.sft import Renderer, load_examples
from lightning_rl.models.loading import load_causal_lm
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing.tree import pack_sequences


@pytest.fixture(scope="module")
def model(tiny_path):
    torch.manual_seed(0)
    m = load_causal_lm(str(tiny_path))
    with torch.no_grad():  # random weights far from the init, so a leak would show in the log-probs
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


@pytest.fixture(scope="module")
def examples(tiny_tokenizer, tmp_path_factory):
    rows = [json.loads(line) for line in TOY_TRAIN.read_text().splitlines()[:6]]
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_examples(path, Renderer(tiny_tokenizer, "tiny"), 512)[0]


def separate_logprobs(model, example):
    """The reference: one sequence alone through the plain model, full logits, log_softmax."""
    ids = torch.tensor(example.input_ids)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    t = torch.nonzero(torch.tensor(example.loss_mask[1:])).flatten() + 1
    return torch.log_softmax(logits[t - 1], dim=-1).gather(1, ids[t, None]).squeeze(1)


def packed(model, examples, share_prefixes):
    batch = pack_sequences([e.input_ids for e in examples], [e.loss_mask for e in examples], share_prefixes=share_prefixes)
    with torch.no_grad():
        logprobs = packed_logprobs(model, batch, chunk_size=5)  # several LM-head chunks
    return batch, [logprobs[batch.loss_seq == i] for i in range(len(examples))]


@pytest.mark.parametrize("share_prefixes", [True, False], ids=["tree", "flat"])
def test_packed_row_equals_separate_runs(model, examples, share_prefixes):
    batch, per_example = packed(model, examples, share_prefixes)
    if share_prefixes:
        assert batch.num_unique_tokens < batch.num_flat_tokens  # the system prompt is stored once
    for example, got in zip(examples, per_example):
        torch.testing.assert_close(got, separate_logprobs(model, example), atol=2e-5, rtol=0)


@pytest.mark.parametrize("share_prefixes", [True, False], ids=["tree", "flat"])
def test_perturbing_one_example_leaves_the_others_unchanged(model, examples, tiny_tokenizer, share_prefixes):
    _, before = packed(model, examples, share_prefixes)
    changed = list(examples)
    victim = changed[2]
    # Replace the user's question (a different length, too) and keep the assistant tokens in place.
    first_trained = victim.loss_mask.index(True)
    new_prompt = victim.input_ids[: first_trained - 8] + tiny_tokenizer.encode("99+98=77<|im_end|>\n<|im_start|>assistant\n")
    changed[2] = type(victim)(new_prompt + victim.input_ids[first_trained:], [False] * len(new_prompt) + victim.loss_mask[first_trained:])
    _, after = packed(model, changed, share_prefixes)
    for i in range(len(examples)):
        if i == 2:
            assert not torch.allclose(after[i], before[i], atol=1e-4)
        else:
            torch.testing.assert_close(after[i], before[i], atol=1e-6, rtol=0)
