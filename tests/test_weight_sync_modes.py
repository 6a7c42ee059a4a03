"""The sync modes into the transformers engine: the adapter sent alone against a merged sync, and only what changed.

Each check compares the engine's log-probs of a fixed batch with the trainer's, and every push is verified by digest
(the engine's `verify_weights`), so a wrong mode would fail both ways.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from support.grpo import LENGTH_REWARD, fit

from lightning_rl.errors import RecipeError
from lightning_rl.models import policy_sync
from lightning_rl.models.loading import LoraSettings
from lightning_rl.models.policy_sync import PolicySync, check_weight_sync, resolve_weight_sync
from lightning_rl.models.weights import WeightMismatchError, adapter_spec, iter_full_weights, tensor_digest
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.rollout.hf import HFRolloutEngine

BATCH = torch.tensor([[3, 9, 14, 2, 33, 7, 21, 5], [8, 1, 40, 12, 6, 6, 19, 30]])
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def base(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


@torch.no_grad()
def logprobs(model: torch.nn.Module) -> torch.Tensor:
    logits = model(input_ids=BATCH).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, BATCH[:, 1:, None])[..., 0]


@torch.no_grad()
def train_step(model: torch.nn.Module, seed: int, only: str | None = None) -> None:
    """A stand-in for an optimizer step: every trainable tensor moves (or only those whose name holds ``only``)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.requires_grad and (only is None or only in name):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def lora_policy(**extra) -> torch.nn.Module:
    return get_peft_model(base(), LoraConfig(**LORA, **extra)).eval()


def test_an_adapter_sync_gives_the_trainers_logprobs_and_what_a_merged_sync_gives() -> None:
    policy = lora_policy()
    by_adapter, by_merge = HFRolloutEngine(base()), HFRolloutEngine(base())
    adapter, merged = PolicySync("adapter"), PolicySync("merged")
    for version in (1, 2):
        train_step(policy, seed=version, only="lora_")
        sent = adapter.sync(policy, by_adapter, version)
        full = merged.sync(policy, by_merge, version)
        assert by_adapter.weight_version == by_merge.weight_version == version
        expected = logprobs(policy)
        assert (logprobs(by_adapter.model) - expected).abs().max() < 1e-5
        assert (logprobs(by_adapter.model) - logprobs(by_merge.model)).abs().max() < 1e-5
        # Only the adapter travels: 2 layers x 7 modules x (A, B), a small part of the merged bytes.
        assert sent.num_tensors == 28 and all("lora_" in name for name in sent.names)
        assert sent.num_bytes < full.num_bytes / 4 and sent.metrics()["sync/bytes"] == sent.num_bytes
    # Negative control: the engine before the second sync no longer fits.
    train_step(policy, seed=9, only="lora_")
    assert (logprobs(by_adapter.model) - logprobs(policy)).abs().max() > 1e-3


def test_an_adapter_sync_onto_an_engine_holding_other_base_weights_is_refused() -> None:
    """The adapter sent alone applies to the base the engine holds: a server given by url may serve another checkpoint
    of the same shape, or weights another run pushed merged. The first adapter sync proves the engine's base the
    trainer's, digest for digest, and refuses in one line otherwise (it passed, and the engine sampled from another
    policy). An engine that does not verify what it holds (``verify_weights: false``) is not asked."""
    policy = lora_policy()
    train_step(policy, seed=1, only="lora_")
    with pytest.raises(WeightMismatchError, match=r"^weight_sync: adapter: the LoRA adapter would be sent alone, onto the base the engine holds, "
                                                  r"and the base weights the engine holds are not the trainer's: the engine's 'model\..*start the engine"):
        PolicySync("adapter").sync(policy, HFRolloutEngine(base(seed=1)), 1)
    merged_before = HFRolloutEngine(base())
    PolicySync("merged").sync(policy, merged_before, 1)
    with pytest.raises(WeightMismatchError, match="not the trainer's"):
        PolicySync("adapter").sync(policy, merged_before, 2)
    engine = HFRolloutEngine(base())
    sync = PolicySync("adapter")
    sync.sync(policy, engine, 1)
    train_step(policy, seed=2, only="lora_")
    sync.sync(policy, engine, 2)  # checked once: the engine's peft copy holds the base as its base layers
    assert (logprobs(engine.model) - logprobs(policy)).abs().max() < 1e-5
    PolicySync("adapter").check_base(policy, engine)  # a new sync's check reads the base through peft's names
    PolicySync("adapter").sync(policy, HFRolloutEngine(base(seed=1), verify_weights=False), 1)
    # A trainer that holds the base in bfloat16 (precision: bf16-true) trains its adapter on other weights than the
    # float32 ones a float32 engine loaded: said as such.
    with pytest.raises(WeightMismatchError, match=r"\(the trainer holds the base in torch.bfloat16, the engine in torch.float32\); load the engine in"):
        PolicySync("adapter").sync(lora_policy().to(torch.bfloat16), HFRolloutEngine(base()), 1)
    # Under auto, such an engine is synced merged instead: the run goes on, on the trainer's weights.
    auto, stale = PolicySync("adapter", "auto"), HFRolloutEngine(base(seed=1))
    assert auto.sync(policy, stale, 1).mode == "merged" and auto.mode == "merged"
    assert (logprobs(stale.model) - logprobs(policy)).abs().max() < 1e-5


def test_an_adapter_with_modules_to_save_reaches_the_transformers_engine() -> None:
    policy = lora_policy(modules_to_save=["model.norm"])
    spec = adapter_spec(policy)
    assert spec.modules_to_save == ("model.norm",) and len(spec.layers) == 14 and spec.layers["model.layers.0.mlp.up_proj"] == "Linear"
    engine = HFRolloutEngine(base())
    train_step(policy, seed=3, only="modules_to_save")
    train_step(policy, seed=4, only="lora_")
    report = PolicySync("adapter").sync(policy, engine, 1)
    assert "base_model.model.model.norm.weight" in report.names
    assert (logprobs(engine.model) - logprobs(policy)).abs().max() < 1e-5


def test_an_adapter_on_the_embeddings_is_refused_merged_and_served_alone() -> None:
    """peft adapts an embedding with ``lora_embedding_A/B``, not ``lora_A/B``: the merged sync used to send that
    embedding unadapted (the engine sampled from another policy, and the check passed). It is refused now, naming
    the module; the adapter sync carries it, and the engine's log-probs are the trainer's."""
    from lightning_rl.models.weights import WeightSyncError, merge_refusal

    policy = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])).eval()
    train_step(policy, seed=6, only="lora_")
    assert "Embedding at model.embed_tokens" in merge_refusal(policy)
    with pytest.raises(WeightSyncError, match="merging LoRA into Embedding at model.embed_tokens is not supported"):
        PolicySync("merged").sync(policy, HFRolloutEngine(base()), 1)
    assert adapter_spec(policy).layers["model.embed_tokens"] == "Embedding"
    engine = HFRolloutEngine(base())
    report = PolicySync("adapter").sync(policy, engine, 1)
    assert any("lora_embedding_B" in name for name in report.names)
    assert (logprobs(engine.model) - logprobs(policy)).abs().max() < 1e-5
    assert (logprobs(base()) - logprobs(policy)).abs().max() > 1e-3  # the adapter changes what is computed


def test_an_adapter_on_a_tied_output_head_is_refused_merged() -> None:
    """A LoRA on ``lm_head`` whose weight the embedding shares adapts the head alone; merged, the one tensor sent
    (under the embedding's name) left the head's adapter out. Refused, naming the module; untied, it merges."""
    from lightning_rl.models.weights import WeightSyncError, merge_refusal

    config = dict(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    tied = get_peft_model(base(), LoraConfig(**config)).eval()
    assert "merging LoRA into lm_head is not supported: another module shares its weight" in merge_refusal(tied)
    with pytest.raises(WeightSyncError, match="merging LoRA into lm_head is not supported"):
        PolicySync("merged").sync(tied, HFRolloutEngine(base()), 1)
    def untied_base() -> Qwen3ForCausalLM:
        model = base()
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        return model

    untied = get_peft_model(untied_base(), LoraConfig(**config)).eval()
    assert merge_refusal(untied) is None
    engine = HFRolloutEngine(untied_base())
    PolicySync("merged").sync(untied, engine, 1)
    assert "lm_head.weight" in dict(iter_full_weights(untied))
    assert (logprobs(engine.model) - logprobs(untied)).abs().max() < 1e-5


def test_an_adapter_tensor_the_engine_did_not_take_is_caught(monkeypatch) -> None:
    import peft

    policy, engine = lora_policy(), HFRolloutEngine(base())
    PolicySync("adapter").sync(policy, engine, 1)
    train_step(policy, seed=5, only="lora_")
    original = peft.set_peft_model_state_dict

    def drops_one(model, state, *args, **kwargs):
        return original(model, {k: v for k, v in state.items() if "layers.1.self_attn.v_proj.lora_B" not in k}, *args, **kwargs)

    monkeypatch.setattr(peft, "set_peft_model_state_dict", drops_one)
    with pytest.raises(WeightMismatchError, match=r"version 2 .*'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight'"):
        PolicySync("adapter").sync(policy, engine, 2)
    assert engine.weight_version == 1


def held_equals_trainer(engine: HFRolloutEngine, model: torch.nn.Module) -> bool:
    held = engine.model.state_dict()
    return all(tensor_digest(held[name]) == tensor_digest(tensor) for name, tensor in iter_full_weights(model))


def test_a_delta_sync_sends_only_what_changed_and_keeps_the_engine_on_the_trainers_weights() -> None:
    policy, engine = base(seed=1), HFRolloutEngine(base())
    sync = PolicySync("delta")
    first = sync.sync(policy, engine, 0)
    assert first.mode == "full" and first.num_tensors == len(list(iter_full_weights(policy)))
    train_step(policy, seed=1, only="layers.1.mlp")
    with torch.no_grad():
        policy.model.norm.weight[0] = -0.0 if policy.model.norm.weight[0] == 0 else policy.model.norm.weight[0]
    second = sync.sync(policy, engine, 1)
    assert second.mode == "delta" and set(second.names) == {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert held_equals_trainer(engine, policy) and (logprobs(engine.model) - logprobs(policy)).abs().max() < 1e-6
    # A sign flip of a zero is a change of bits: sent, never skipped as "equal".
    with torch.no_grad():
        policy.model.norm.weight[0] = 0.0
        policy.model.norm.weight[1] = 0.0
    assert sync.sync(policy, engine, 2).names == ["model.norm.weight"]
    with torch.no_grad():
        policy.model.norm.weight[0] = -0.0
    assert sync.sync(policy, engine, 3).names == ["model.norm.weight"]
    assert sync.sync(policy, engine, 4).num_bytes == 0 and engine.weight_version == 4


def test_a_delta_sends_a_tensors_changed_elements_alone_where_few_changed() -> None:
    # bf16 weights moved by a step smaller than most values' spacing: few of them change, and only those travel.
    policy, engine = base(seed=1).to(torch.bfloat16), HFRolloutEngine(base().to(torch.bfloat16))
    sync = PolicySync("delta")
    sync.sync(policy, engine, 0)
    with torch.no_grad():
        policy.model.layers[0].mlp.up_proj.weight.add_(1e-6)  # rounds back to the same bf16 value almost everywhere
        policy.model.layers[0].mlp.up_proj.weight[3, :5] = 0.25  # and five values that certainly changed
        policy.model.layers[1].self_attn.o_proj.weight.add_(1.0)  # every value changed: sent whole
    changed = int((sync.delta.copies["model.layers.0.mlp.up_proj.weight"].view(torch.int16)
                   != policy.model.layers[0].mlp.up_proj.weight.view(torch.int16)).sum())
    report = sync.sync(policy, engine, 1)
    whole = policy.model.layers[1].self_attn.o_proj.weight
    assert report.mode == "delta" and sorted(report.names) == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
    assert 5 <= changed < 200 and report.num_bytes == changed * (2 + 4) + whole.numel() * 2  # bf16 values, int32 indices
    assert held_equals_trainer(engine, policy) and (logprobs(engine.model) - logprobs(policy)).abs().max() == 0
    # An element changed inside the engine is not covered by the changes: the digest of the whole tensor sees it.
    with torch.no_grad():
        engine.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
        policy.model.layers[0].mlp.up_proj.weight[5, 0] = -1.0
    assert sync.sync(policy, engine, 2).mode == "full" and held_equals_trainer(engine, policy)


def test_a_delta_sync_falls_back_to_full_after_a_restart_a_resume_and_a_failed_check(monkeypatch, caplog) -> None:
    policy, engine = base(seed=1), HFRolloutEngine(base())
    sync = PolicySync("delta")
    sync.sync(policy, engine, 0)
    train_step(policy, seed=1, only="q_proj")
    assert sync.sync(policy, engine, 1).mode == "delta"
    # An engine that does not hold the version last sent (restarted, or written by another sync): full.
    restarted = HFRolloutEngine(base())
    train_step(policy, seed=2, only="q_proj")
    assert sync.sync(policy, restarted, 2).mode == "full" and held_equals_trainer(restarted, policy)
    # A resume starts with no kept copy: full.
    resumed = PolicySync("delta")
    assert resumed.sync(policy, restarted, 3).mode == "full"
    # A tensor changed inside the engine, which a delta would not send: its check fails, and a full sync repairs it.
    with torch.no_grad():
        restarted.model.model.layers[0].self_attn.o_proj.weight[0, 0] += 1.0
    train_step(policy, seed=3, only="layers.1.self_attn.q_proj")
    gathers = []  # the fallback sends the copies the delta's stream left: one gather, as on every other rank
    monkeypatch.setattr(policy_sync, "iter_full_weights", lambda *a, **k: gathers.append(1) or iter_full_weights(*a, **k))
    with caplog.at_level("WARNING", logger="lightning_rl.models.policy_sync"):
        report = resumed.sync(policy, restarted, 4)
    assert report.mode == "full" and restarted.weight_version == 4 and held_equals_trainer(restarted, policy)
    assert "weight_sync: delta: the engine does not hold what the syncs before this one sent" in caplog.text  # said, not only counted
    assert len(gathers) == 1
    monkeypatch.undo()
    train_step(policy, seed=4, only="layers.1.self_attn.q_proj")
    assert resumed.sync(policy, restarted, 5).names == ["model.layers.1.self_attn.q_proj.weight"]


def test_modes_are_refused_in_one_line_naming_the_key() -> None:
    with pytest.raises(RecipeError, match="weight_sync: adapter sends a LoRA adapter, and the recipe trains no model.lora") as caught:
        check_weight_sync("adapter", lora=False)
    assert caught.value.key == "weight_sync"
    with pytest.raises(RecipeError, match="say merged"):
        check_weight_sync("full", lora=True)
    with pytest.raises(RecipeError, match="must be one of auto, full, merged, adapter, delta"):
        check_weight_sync("sparse", lora=False)

    class ReadOnly:
        def push_weights(self, named_tensors, version):
            return None

    with pytest.raises(RecipeError, match="weight_sync: delta: ReadOnly cannot write some tensors in place"):
        resolve_weight_sync("delta", base(), ReadOnly(), lora=False)
    policy = lora_policy()
    assert resolve_weight_sync("auto", policy, ReadOnly(), lora=True) == "merged"
    assert resolve_weight_sync("auto", policy, HFRolloutEngine(base()), lora=True) == "adapter"
    assert resolve_weight_sync("auto", base(), HFRolloutEngine(base()), lora=False) == "full"
    with pytest.raises(RecipeError, match="weight_sync: adapter: ReadOnly applies no adapter sent alone"):
        resolve_weight_sync("adapter", policy, ReadOnly(), lora=True)


class EngineState(L.Callback):
    """What the engine and the trainer hold when training ends (the engine closes with fit), and the sync figures."""

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self.version, self.mode = pl_module.engine.weight_version, pl_module.weight_sync.mode
        self.error = (logprobs(pl_module.engine.model) - logprobs(pl_module.policy.eval())).abs().max().item()
        self.logged = {k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("train/sync/")}


@pytest.mark.parametrize(("lora", "weight_sync", "mode"), [
    pytest.param(LoraSettings(r=4, alpha=8), "auto", "adapter", id="lora-auto-adapter"),
    pytest.param(None, "delta", "delta", id="full-delta"),
])
def test_grpo_syncs_in_its_mode_and_logs_what_each_sync_cost(lora, weight_sync, mode) -> None:
    state = EngineState()
    fit(2, [state], lora=lora, weight_sync=weight_sync, learning_rate=1e-2, rewards=LENGTH_REWARD)
    assert state.version == 2 and state.mode == mode
    assert state.error < 1e-5  # the engine holds the trained policy: adapter applied, or every changed tensor written
    assert set(state.logged) == {f"train/sync/{k}" for k in ("bytes", "pause_s", "seconds", "count", "full")}
    assert state.logged["train/sync/bytes"] > 0 and 0 <= state.logged["train/sync/pause_s"] <= state.logged["train/sync/seconds"]
    assert state.logged["train/sync/count"] == 1 and state.logged["train/sync/full"] == 0  # the last step's: a delta, an adapter


class SyncFigures(L.Callback):
    """Each step's logged sync figures."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.state_bytes = 0

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.state_bytes = sum(p.numel() * p.element_size() for p in pl_module.policy.parameters())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k.removeprefix("train/sync/"): float(v) for k, v in trainer.logged_metrics.items() if k.startswith("train/sync/")})


def test_the_sync_a_run_or_a_resume_starts_with_is_logged_with_its_first_step(tmp_path) -> None:
    """The full sync a run (or a resume: a delta's first push sends everything) starts with was overwritten by its first
    step's push before it was logged: the bytes of a resume's fall-back to a full sync never showed."""
    figures = SyncFigures()
    fit(3, [figures], weight_sync="delta", learning_rate=1e-2, rewards=LENGTH_REWARD)
    first, later = figures.steps[0], figures.steps[1:]
    assert first["count"] == 2 and first["full"] == 1  # the start's full push, and the first step's delta
    assert all(step["count"] == 1 and step["full"] == 0 for step in later)
    assert first["bytes"] > figures.state_bytes >= max(step["bytes"] for step in later) > 0  # every weight, and a delta


def test_grpo_refuses_an_adapter_sync_without_lora_before_anything_loads() -> None:
    with pytest.raises(RecipeError, match="weight_sync: adapter sends a LoRA adapter"):
        GRPOModule(weight_sync="adapter")


def test_lora_serving_is_turned_on_for_an_engine_given_by_class_path_too():
    """A class_path's init_args hold every default, ``max_lora_rank: None`` included: the adapter's rank was not set,
    so ``auto`` synced merged weights and ``adapter`` was refused."""
    from lightning_rl.models.policy_sync import engine_options_for

    class Engine:
        def __init__(self, model: str, max_lora_rank: int | None = None) -> None: ...

    assert engine_options_for(Engine, {"max_lora_rank": None}, "auto", 8) == {"max_lora_rank": 8}
    assert engine_options_for(Engine, {}, "adapter", 8) == {"max_lora_rank": 8}
    assert engine_options_for(Engine, {"max_lora_rank": 32}, "auto", 8) == {"max_lora_rank": 32}  # the recipe's own
    assert engine_options_for(Engine, {"max_lora_rank": None}, "merged", 8) == {"max_lora_rank": None}
    # An engine that serves LoRA on a MoE model on a GPU only: `auto` leaves it off there (it would not generate).
    Engine.MOE_LORA_NEEDS_CUDA = True
    assert engine_options_for(Engine, {}, "auto", 8, moe=True) == ({"max_lora_rank": 8} if torch.cuda.is_available() else {})
    assert engine_options_for(Engine, {}, "auto", 8, moe=False) == engine_options_for(Engine, {}, "adapter", 8, moe=True) == {"max_lora_rank": 8}


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_an_adapter_that_trains_biases_is_not_one_vllm_serves(bias) -> None:
    """vLLM loads no adapter biases (its first push died inside vLLM): refused, so `auto` syncs it merged."""
    from lightning_rl.rollout.vllm_engine import vllm_adapter_refusal

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    spec = adapter_spec(get_peft_model(base(), LoraConfig(r=4, target_modules=targets, bias=bias)))
    assert vllm_adapter_refusal(spec, 8, targets, "Qwen3ForCausalLM") == f"vLLM cannot serve an adapter that trains biases (bias: {bias})"
    plain = adapter_spec(get_peft_model(base(), LoraConfig(r=4, target_modules=targets)))
    assert vllm_adapter_refusal(plain, 8, targets, "Qwen3ForCausalLM") is None


@pytest.mark.parametrize("pattern", [{"rank_pattern": {"q_proj": 2}}, {"alpha_pattern": {"v_proj": 5}}])
def test_an_adapter_with_per_module_ranks_or_alphas_is_not_sent_alone(pattern) -> None:
    """The engine reads its held A and B back at the config's one rank and scaling: a module of its own rank or
    alpha failed that check though vLLM served it right. Refused, so `auto` syncs it merged."""
    from lightning_rl.rollout.vllm_engine import vllm_adapter_refusal

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    spec = adapter_spec(get_peft_model(base(), LoraConfig(r=4, target_modules=targets, **pattern)))
    key = next(iter(pattern))
    assert vllm_adapter_refusal(spec, 8, targets, "Qwen3ForCausalLM").startswith(f"an adapter with per-module ranks or alphas ({key}: ")


def test_an_adapter_on_an_embedding_is_refused_without_listing_the_embedding_as_served() -> None:
    """vLLM lists ``embed_tokens`` among its LoRA targets, and the refusal of an adapter on it read "serves LoRA on
    ..., embed_tokens, ... not on model.embed_tokens"."""
    from lightning_rl.rollout.vllm_engine import vllm_adapter_refusal

    targets = ["q_proj", "embed_tokens"]
    spec = adapter_spec(get_peft_model(base(), LoraConfig(r=4, target_modules=targets)))
    assert vllm_adapter_refusal(spec, 8, targets, "Qwen3ForCausalLM") == "vLLM's Qwen3ForCausalLM serves LoRA on q_proj, not on model.embed_tokens (Embedding)"


@pytest.mark.parametrize("mode", ["merged", "delta"])
def test_a_module_trained_whole_beside_lora_is_sent_as_trained_under_its_own_name(mode) -> None:
    """peft's modules_to_save keeps the frozen original and the trained copy under names of its own: a merged (or
    delta) sync sent both under those names, and the engine refused the first as a tensor it does not have."""
    policy = lora_policy(modules_to_save=["model.norm"])
    engine = HFRolloutEngine(base())
    sync = PolicySync(mode)
    for version in (1, 2):
        train_step(policy, seed=version, only="modules_to_save")
        train_step(policy, seed=10 + version, only="lora_")
        report = sync.sync(policy, engine, version)
        assert "model.norm.weight" in report.names and not any("original_module" in n or "modules_to_save" in n for n in report.names)
        assert (logprobs(engine.model) - logprobs(policy)).abs().max() < 1e-5


def test_a_tied_module_trained_whole_is_refused_before_a_sync() -> None:
    """A tied embedding trained whole beside LoRA: the trainer's head went on using the original while the engine read
    the trained copy in both (1.6 nats apart, no refusal). Refused, naming the module, before anything is sent."""
    from lightning_rl.models.weights import WeightSyncError, merge_refusal

    policy = lora_policy(modules_to_save=["model.embed_tokens"])
    assert "model.embed_tokens is trained whole (modules_to_save), but its weight is tied" in merge_refusal(policy)
    with pytest.raises(WeightSyncError, match="model.embed_tokens is trained whole"):
        PolicySync("merged").sync(policy, HFRolloutEngine(base()), 1)
    assert merge_refusal(lora_policy(modules_to_save=["model.norm"])) is None
