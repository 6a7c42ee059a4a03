"""Router replay: the experts the engine routed each token to, recorded by the transformers engine, are the experts
the trainer's packed forward uses, while the gate's own probabilities weigh them.

Real tiny models of five families (their own router rules), the real transformers engine and the real packed
forward; the reference is the engine's own log-probs, or each sequence run alone under the same routes.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from transformers import MuseSparkTextConfig
from transformers.models.muse_spark.modeling_muse_spark import MuseSparkMoE

from lightning_rl.errors import UserError
from lightning_rl.models.routing import (
    ROUTERS, RouteAgreement, RouteReplay, RouterReplayError, find_routers, record_routes, replaying, router_replay_on,
)
from lightning_rl.models.structure import enable_activation_checkpointing
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing.tree import pack_sequences
from lightning_rl.rollout.base import SamplingConfig
from lightning_rl.rollout.hf import HFRolloutEngine
from lightning_rl.rollout.vllm_server_process import free_port
from lightning_rl.strategies.expert_parallel import distribute_experts, expert_mesh
from support import tiny_models, tiny_moe
from support.distributed import leave_worker

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def _rollouts(model, n=3, seed=0):
    engine = HFRolloutEngine(copy.deepcopy(model), seed=seed, pad_token_id=2, eos_token_id=1)
    engine.record_routes = True
    return engine.generate(PROMPTS, n, SamplingConfig(max_new_tokens=6, temperature=1.0)).groups


def _row(rollouts):
    """The G completions of a prompt as one tree-packed row, with their engine log-probs and routes."""
    return pack_sequences(
        [r.sequence for r in rollouts], [r.loss_mask for r in rollouts],
        token_values={"engine": [r.sequence_logprobs for r in rollouts]}, routes=[r.routes for r in rollouts],
    )  # fmt: skip


def _logprobs(model, row, **kwargs):
    agreement = RouteAgreement()
    with torch.no_grad():
        out = packed_logprobs(model, row, route_agreement=agreement, **kwargs)
    return out, agreement.value


@pytest.mark.parametrize("family", tiny_moe.FAMILIES)
def test_engine_routes_replayed_give_the_engine_logprobs(family):
    model = tiny_moe.build(family)
    for group in _rollouts(model):
        routes = group[0].routes
        assert routes.shape == (len(group[0].sequence), len(find_routers(model)), 2) and routes.dtype == torch.int16
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()  # the last token is never forwarded
        row = _row(group)
        logprobs, agreement = _logprobs(model, row)
        assert agreement == 1.0
        torch.testing.assert_close(logprobs, row.token_values["engine"], rtol=0, atol=1e-5)


def test_a_router_with_a_lora_is_replayed_like_the_router_itself():
    """A recipe's LoRA (``all-linear``) reaches the router's weight through peft's parameter wrapper, which makes the
    router a parametrized subclass of its class while it forwards: still replayed, by its class's rule."""
    from lightning_rl.models.loading import LoraSettings, load_causal_lm

    policy = load_causal_lm("tiny-moe", lora=LoraSettings(r=4, alpha=8)).eval()
    assert any(type(m).__name__ == "ParamWrapper" and m.parameter_name == "weight" and "gate" in name
               for name, m in policy.named_modules())  # fmt: skip
    for group in _rollouts(policy.base_model.model):  # the transformers model, the adapters in place
        row = _row(group)
        logprobs, agreement = _logprobs(policy, row)
        assert agreement == 1.0
        torch.testing.assert_close(logprobs, row.token_values["engine"], rtol=0, atol=1e-5)


def _perturb(model, family, seed=1):
    """Noise on the routers: on the selection bias alone for the sigmoid families (the weights of a given choice do
    not change), on the gate weights for the softmax ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model):
            target = router.e_score_correction_bias if family in ("deepseek_v3", "muse_spark") else router.weight
            target.add_(torch.randn(target.shape, generator=g) * 0.5)


@pytest.mark.parametrize("family", ["muse_spark", "deepseek_v3"])
def test_a_perturbed_selection_disagrees_and_replay_restores_the_engine_logprobs(family):
    engine_model = tiny_moe.build(family)
    trainer = copy.deepcopy(engine_model)
    _perturb(trainer, family)
    for group in _rollouts(engine_model):
        row = _row(group)
        own, own_agreement = _logprobs(trainer, row, replay_routes=False)
        replayed, agreement = _logprobs(trainer, row)
        assert own_agreement < 1 and agreement < 1  # the trainer's own choice is not the engine's
        assert float((own - row.token_values["engine"]).abs().max()) > 1e-3
        torch.testing.assert_close(replayed, row.token_values["engine"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "muse_spark"])
def test_tree_packed_rows_with_replay_equal_each_sequence_alone(family):
    engine_model = tiny_moe.build(family)
    trainer = copy.deepcopy(engine_model)
    _perturb(trainer, family)  # so the replayed routes are not the trainer's own
    group = _rollouts(engine_model)[0]
    row = _row(group)
    packed, agreement = _logprobs(trainer, row)
    unreplayed, _ = _logprobs(trainer, row, replay_routes=False)
    assert agreement < 1 and float((packed - unreplayed).abs().max()) > 1e-3
    for i, rollout in enumerate(group):
        alone = pack_sequences([rollout.sequence], [rollout.loss_mask], routes=[rollout.routes])
        want, _ = _logprobs(trainer, alone)
        torch.testing.assert_close(packed[row.loss_seq == i], want, rtol=0, atol=1e-5)


def test_the_gate_gets_gradients_under_replay_and_a_checkpointed_layer_replays_in_backward():
    model = tiny_moe.build("qwen3_moe").train()
    row = _row(_rollouts(model)[0])
    grads = []
    for checkpointed in (False, True):
        trained = copy.deepcopy(model)
        _perturb(trained, "qwen3_moe")
        if checkpointed:  # each decoder layer recomputed in backward, where the routes must be replayed again
            enable_activation_checkpointing(trained)
        packed_logprobs(trained, row).sum().backward()
        grads.append({name: p.grad.clone() for name, p in trained.named_parameters() if p.grad is not None})
    gate = next(name for name in grads[0] if name.endswith("mlp.gate.weight"))
    assert grads[0][gate].abs().sum() > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_recorder_and_the_rule_check_cover_every_router():
    model = tiny_moe.build("muse_spark")
    with record_routes(model) as recorded, torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert len(recorded.calls) == 1 and recorded.calls[0].shape == (3, 4, 2)
    # A rule that no longer gives the router's own weights is refused, not replayed.
    name = "MuseSparkTopkRouter"
    rule = ROUTERS[name]
    ROUTERS[name] = lambda router, logits, indices: rule(router, logits, indices) * 2
    try:
        with pytest.raises(RuntimeError, match="no longer gives the router's own weights"), replaying(model, RouteReplay(recorded.calls[0])), torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
    finally:
        ROUTERS[name] = rule


def test_shared_prefix_tokens_are_routed_once_and_forks_must_agree():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[1, 2]], [[-1, -1]]], dtype=torch.int16)  # 4 tokens, 1 layer, top-2
    b = torch.tensor([[[1, 0]], [[2, 3]], [[0, 3]], [[-1, -1]]], dtype=torch.int16)  # same experts, other order
    row = pack_sequences([[5, 6, 7, 8], [5, 6, 9, 10]], routes=[a, b])
    assert row.routes.shape == (6, 1, 2)
    # The sequence that ends where another goes on: its last token, unrouted, takes the other's route.
    row = pack_sequences([[5, 6, 7], [5, 6, 7, 8]], routes=[a[[0, 1, 3]], a])
    assert row.routes[2].tolist() == [[1, 2]]
    clash = b.clone()
    clash[1, 0] = torch.tensor([2, 4])
    with pytest.raises(ValueError, match="sequence 1: token 1 is routed to other experts"):
        pack_sequences([[5, 6, 7, 8], [5, 6, 9, 10]], routes=[a, clash])


def test_the_recipe_key_refuses_what_cannot_replay():
    dense, moe = tiny_models.build("qwen3"), tiny_moe.build("qwen3_moe")
    assert router_replay_on("auto", moe, "hf", True) and not router_replay_on("auto", moe, "vllm", False)
    assert not router_replay_on("auto", dense, "hf", True) and not router_replay_on(False, moe, "hf", True)
    with pytest.raises(RouterReplayError) as dense_error:
        router_replay_on(True, dense, "hf", True)
    with pytest.raises(RouterReplayError) as engine_error:
        router_replay_on(True, moe, "vllm", False)
    for error in (dense_error.value, engine_error.value):  # the run names the module's key within its block
        assert isinstance(error, UserError) and error.within("model").key == "model.router_replay"
        assert error.line().startswith("model.router_replay: true, but") and "\n" not in error.line()
    # A mixture-of-experts family whose router the table does not know: refused when asked, off on auto.
    unknown = copy.deepcopy(moe)
    for layer in unknown.model.layers:
        layer.mlp.gate.__class__ = type("OtherRouter", (type(layer.mlp.gate),), {})
    assert not router_replay_on("auto", unknown, "hf", True)
    with pytest.raises(RouterReplayError, match="with a router lightning_rl.models.routing does not know"):
        router_replay_on(True, unknown, "hf", True)


def _expert_parallel_check(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        config = MuseSparkTextConfig(
            hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_hidden_size=8,
            moe_intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
        torch.manual_seed(0)
        layer = MuseSparkMoE(config)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        dense = copy.deepcopy(layer)
        distribute_experts(layer, expert_mesh("cpu", 2, 2))
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randn(7 + rank, 16, generator=g)
        routes = torch.stack([torch.randperm(4, generator=g)[:2] for _ in tokens])[:, None].to(torch.int16)  # [T, 1, 2]
        outputs, agreements = [], []
        for module in (layer, dense):
            x = tokens.clone().requires_grad_()
            replay = RouteReplay(routes)
            with replaying(module, replay):
                out = module(x)
            out.square().sum().backward()
            outputs.append((out, x.grad, module.gate.weight.grad))
            agreements.append(replay.agreement.value)
        for got, want in zip(*outputs):  # the split layer under replay computes what the whole one does
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert agreements[0] == agreements[1] < 1  # random routes are not the gate's own choice
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_worker()


def test_replay_forces_the_experts_before_expert_parallel_dispatch():
    torch.multiprocessing.spawn(_expert_parallel_check, args=(free_port(),), nprocs=2)
