"""A reward model as a reward: a real from_pretrained sequence-classification model (a tiny Qwen3 with one label,
the embedded tokenizer and its chat template), batched against one at a time, and inside a GRPO run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from support.grpo import LENGTH_REWARD, fit
from lightning_rl.errors import RecipeError
from lightning_rl.rewards import RewardScorer, RewardSpec
from lightning_rl.rewards.model import RewardModel


@pytest.fixture(scope="module")
def reward_model_path(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("reward-model")
    config = AutoConfig.from_pretrained(tiny_path, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ between texts
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(folder)
    return folder


PROMPTS = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "And 3+5, please?"}]]  # fmt: skip


def test_batched_scores_equal_one_text_at_a_time_under_the_models_own_template(reward_model_path):
    reward = RewardModel(str(reward_model_path), batch_size=3)
    messages = [PROMPTS[i % 2] for i in range(5)]
    completions = ["4", "8, which is the sum of three and five", "four", "", "8"]
    scores = reward(messages, completions)
    assert len(scores) == 5 and len(set(scores)) == 5
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval()
    for m, c, score in zip(messages, completions, scores, strict=True):
        text = tokenizer.apply_chat_template([*m, {"role": "assistant", "content": c}], tokenize=False)
        assert "<|im_start|>assistant" in text or c in text
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
        assert score == pytest.approx(float(want), abs=1e-5)


def test_a_reward_model_is_a_recipe_reward_and_its_mistakes_are_one_line(reward_model_path, tmp_path):
    scorer = RewardScorer([RewardSpec("reward_model", kwargs={"path": str(reward_model_path), "batch_size": 2})])
    scores = scorer.score(["p", "p"], ["4", "5"], {"prompt_messages": [PROMPTS[0], PROMPTS[0]]})
    assert scores.errors == [] and scores.per_function["reward_model"][0] != scores.per_function["reward_model"][1]
    with pytest.raises(ValueError, match=r"reward 'reward_model': cannot be built from kwargs .*batch_size must be an integer >= 1"):
        RewardScorer([RewardSpec("reward_model", kwargs={"path": str(reward_model_path), "batch_size": 0})])
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got True"):  # a bool is no count
        RewardScorer([RewardSpec("reward_model", kwargs={"path": str(reward_model_path), "batch_size": True})])
    with pytest.raises(ValueError, match=r"reward 'reward_model': cannot be built from kwargs .*unexpected keyword argument 'batchsize'"):
        RewardScorer([RewardSpec("reward_model", kwargs={"path": str(reward_model_path), "batchsize": 2})])
    # A conversational prompt's completion with a tool call and its result: the reward model reads the whole exchange
    # (a tool-calling rollout scored as its last reply alone before, unlike TRL).
    exchange = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
                {"role": "tool", "name": "add", "content": "4"}, {"role": "assistant", "content": "4"}]  # fmt: skip
    scores = scorer.score(["p", "p"], ["4", "4"], {"prompt_messages": [PROMPTS[0], PROMPTS[0]]}, chat_prompts=[PROMPTS[0]] * 2,
                          chat_completions=[exchange, [{"role": "assistant", "content": "4"}]])  # fmt: skip
    whole = RewardModel(str(reward_model_path))([PROMPTS[0]], [exchange])
    assert scores.per_function["reward_model"].tolist()[0] == pytest.approx(whole[0]) and whole[0] != pytest.approx(scores.per_function["reward_model"].tolist()[1])
    assert "<tool_response>4</tool_response>" in RewardModel(str(reward_model_path)).texts([PROMPTS[0]], [exchange])[0]
    with pytest.raises(ValueError, match="RecipeError: path: no model folder at "):
        RewardScorer([RewardSpec("reward_model", kwargs={"path": str(tmp_path / "no-such-model")})])
    classifier = tmp_path / "three-labels"  # a classifier, not a reward model
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(reward_model_path, num_labels=3)).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(reward_model_path).save_pretrained(classifier)
    with pytest.raises(ValueError, match="it has 3 labels; a reward model has 1"):
        RewardModel(str(classifier))


def test_a_grpo_run_scores_with_a_reward_model_beside_a_function(reward_model_path):
    rewards = [RewardSpec("reward_model", weight=0.5, kwargs={"path": str(reward_model_path)}), *LENGTH_REWARD]
    module, trainer = fit(2, batch_size=2, rewards=rewards)
    terms = module.last_trained.reward_terms
    assert set(terms) == {"reward_model", "text_length"} and len(set(terms["reward_model"])) > 1
    assert float(trainer.callback_metrics["train/reward/reward_model/errors"]) == 0


def _gpt2(tiny_path: Path, folder: Path) -> None:
    """GPT-2's learned positions (64 of them), its tokenizer set to pad on the left."""
    from transformers import GPT2Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**saved, "padding_side": "left"}))  # as a model's folder may say
    assert AutoTokenizer.from_pretrained(folder).padding_side == "left"


def _gemma3(tiny_path: Path, folder: Path) -> None:
    """Gemma 3's composite config (the pad id the head reads is its text config's), a tokenizer without a pad token."""
    from transformers import Gemma3Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    tokenizer.pad_token = None
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, pad_token_id=0, sliding_window=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7, num_labels=1)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("build", [_gpt2, _gemma3], ids=["gpt2-left-padding", "gemma3-nested-pad-id"])
def test_a_batch_scores_each_text_as_it_scores_alone_whatever_the_model_and_tokenizer(build, tiny_path, tmp_path):
    """Padded on the tokenizer's side (left), a model of learned positions read a row at other positions; the pad id
    set on the outer config of a composite one was not the one its head reads: batched scores were other numbers.
    TRL pads on the right and sets the text config's."""
    build(tiny_path, tmp_path)
    completions = ["4", "8, which is the sum of three and five", "four"]
    batched = RewardModel(str(tmp_path), batch_size=3)([PROMPTS[0]] * 3, completions)
    alone = [RewardModel(str(tmp_path), batch_size=1)([PROMPTS[0]], [completion])[0] for completion in completions]
    assert len(set(batched)) == 3 and batched == pytest.approx(alone, abs=1e-5)


def test_a_text_past_the_reward_models_positions_is_cut_from_the_left(tiny_path, tmp_path):
    """max_length None is the model's limit: a text past GPT-2's 64 positions failed inside the model (an IndexError,
    which a run scored 0), where its last 64 tokens are what the reward reads."""
    _gpt2(tiny_path, tmp_path)
    reward = RewardModel(str(tmp_path))
    long = " ".join(["two and two make four"] * 30)
    (score,) = reward([PROMPTS[0]], [long])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(reward.texts([PROMPTS[0]], [long])[0], add_special_tokens=False)["input_ids"]
    assert len(ids) > 64
    with torch.no_grad():
        want = reward.model(input_ids=torch.tensor([ids[-64:]])).logits[0, 0]
    assert score == pytest.approx(float(want), abs=1e-5)


def test_a_folder_that_is_not_a_one_label_classifier_or_cannot_pad_is_refused_before_training(reward_model_path, tiny_path, tmp_path):
    """A causal LM's folder loaded as a classifier whose score head was newly initialized (random), a tokenizer that
    cannot pad a batch and a max_length that is no length failed at the first step, or trained on a random score."""
    from transformers import AutoModelForCausalLM

    causal = tmp_path / "causal-lm"  # a causal LM's export, num_labels set to 1: its folder has no score head
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_path, num_labels=1)).save_pretrained(causal)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(causal)
    with pytest.raises(ValueError, match=rf"reward model {causal}: it is not a sequence-classification checkpoint \(its config's architectures: Qwen3ForCausalLM\)"):
        RewardModel(str(causal))
    saved = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "architectures"}))  # the config says nothing
    with pytest.raises(ValueError, match=rf"reward model {causal}: its checkpoint lacks score.weight \(1 weights\), which would be newly initialized"):
        RewardModel(str(causal))
    for bad in (0, -1, 8.0, "512", True):
        with pytest.raises(ValueError, match=r"reward 'reward_model': cannot be built from kwargs .*max_length must be an integer >= 1 or null"):
            RewardScorer([RewardSpec("reward_model", kwargs={"path": str(reward_model_path), "max_length": bad})])
    unpadded = tmp_path / "no-pad-no-eos"
    AutoModelForSequenceClassification.from_pretrained(reward_model_path).save_pretrained(unpadded)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    tokenizer.pad_token = tokenizer.eos_token = None
    tokenizer.save_pretrained(unpadded)
    with pytest.raises(ValueError, match=rf"reward model {unpadded}: its tokenizer has neither a pad token nor an eos token"):
        RewardModel(str(unpadded))


def test_without_a_chat_template_a_string_prompt_is_read_as_trl_reads_it_and_a_conversation_stops_the_run(reward_model_path, tmp_path):
    """Without a chat template the turns' contents were joined by newlines, a system prompt's too: TRL reads a string
    prompt as written followed by the completion, and cannot render a conversational one (it raises)."""
    AutoModelForSequenceClassification.from_pretrained(reward_model_path).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    reward = RewardModel(str(tmp_path))
    as_rendered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2 ="}]  # a string prompt's
    assert reward.texts([as_rendered], [" 4"]) == ["2+2 = 4"]
    scorer = RewardScorer([RewardSpec("reward_model", kwargs={"path": str(tmp_path)})])
    scores = scorer.score(["p", "p"], [" 4", " 5"], {"prompt_messages": [as_rendered] * 2})
    assert scores.errors == [] and scores.per_function["reward_model"].tolist() == pytest.approx(reward([as_rendered] * 2, [" 4", " 5"]))
    with pytest.raises(RecipeError, match=rf"^reward model {tmp_path}: its tokenizer has no chat template to render a conversational prompt"):
        scorer.score(["p", "p"], ["4", "5"], {"prompt_messages": [PROMPTS[0]] * 2}, chat_prompts=[PROMPTS[0]] * 2,
                     chat_completions=[[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]])  # fmt: skip
