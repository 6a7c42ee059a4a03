"""Fidelity to TRL 1.16: on one batch (same rollouts, advantages, old, engine and reference log-probs)
our tree-packed GRPO loss and its gradients equal what TRL's `GRPOTrainer._compute_loss` computes on
the same batch, padded and unpacked, for each loss type and each option of `GRPOLoss`. TRL is a
test-only reference.

The batch is one TRL micro-batch (no gradient accumulation, one process): TRL normalises grpo, bnpo,
dr_grpo, sapo and luspo, its entropy bonus and its top-entropy quantile per micro-batch, we over the
whole optimizer step, and the two agree when the step is one micro-batch."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer  # the reference: trl==1.16.0 from the dev extra

from lightning_rl.losses import GRPOLoss, StepCounts
from lightning_rl.ops.logprobs import LogitTransform, lm_head_of, token_logprobs
from lightning_rl.ops.packed_forward import packed_hidden_states
from lightning_rl.toy.model import tiny_model_path
from lightning_rl.modules.grpo import GRPOModule
from lightning_rl.modules.grpo_metrics import StepStats
from lightning_rl.rollout.base import Rollout, padded_rollouts

G = 3
MAX_NEW = 6
TEMPERATURE = 0.8
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": TEMPERATURE}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to share: on a busy machine, intra-op threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_path():
    return tiny_model_path()


def _rollouts(vocab: int) -> list[Rollout]:
    """Two prompts of different lengths, G completions each of different lengths (one is empty
    of trained tokens past the first), with made-up engine log-probs."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (5,), generator=gen).tolist(), torch.randint(10, vocab, (8,), generator=gen).tolist()]
    rollouts = []
    for g, prompt in enumerate(prompts):
        for k in range(G):
            length = [MAX_NEW, 3, 1][k] if g == 0 else [4, MAX_NEW, 5][k]
            completion = torch.randint(10, vocab, (length,), generator=gen).tolist()
            engine = (-3.0 - torch.rand(length, generator=gen)).tolist()
            rollouts.append(Rollout(prompt, completion, engine, weight_version=0, group_id=g))
    return rollouts


@torch.no_grad()
def _unpacked_logprobs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per completion token log-probs from a plain padded forward (an independent reference)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float() / TEMPERATURE
    width_c = batch["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -width_c - 1:-1], -1)
    return logp.gather(-1, batch["completion_ids"][..., None])[..., 0]


CASES = [
    pytest.param("grpo", 0.0, "trainer", None, True, id="grpo"),
    pytest.param("dapo", 0.0, "trainer", None, True, id="dapo"),
    pytest.param("grpo", 0.05, "engine", None, True, id="grpo-kl-clipped"),
    pytest.param("bnpo", 0.05, "engine", None, False, id="bnpo-plain-kl-clipped"),
    pytest.param("dr_grpo", 0.05, "trainer", 1.5, True, id="dr_grpo-kl-is"),
]


@pytest.mark.parametrize("loss_type,beta,old,is_cap,kl_correction", CASES)
def test_loss_and_gradients_match_trl(model_path, tmp_path, loss_type, beta, old, is_cap, kl_correction):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ours = GRPOModule(
        model_name_or_path=str(model_path), num_generations=G, sampling=SAMPLING,
        loss=GRPOLoss(loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta, importance_sampling_cap=is_cap,
                      importance_sampling_mode="token_truncate", kl_bias_correction=kl_correction), old_logprobs=old,
    )
    ours.configure_model()
    if ours.reference is not None:  # a reference that differs from the policy, so the KL term matters
        with torch.no_grad():
            for p in ours.reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
    theirs_model = copy.deepcopy(ours.policy)

    rollouts = _rollouts(len(tokenizer))
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 1.2, -1.5])
    batch = padded_rollouts(rollouts, tokenizer.pad_token_id)
    # Computed before our packed forward switches the models to tree attention.
    ref_logprobs = _unpacked_logprobs(ours.reference, batch) if beta else None
    trainer_logprobs = _unpacked_logprobs(theirs_model, batch)

    packed = ours.pack_rollouts(rollouts, advantages)
    terms, _ = ours.row_loss(packed)
    tokens = int(batch["completion_mask"].sum())
    counts = StepCounts(num_sequences=len(rollouts), num_tokens=tokens, rank_tokens=tokens, max_completion_length=MAX_NEW)
    seq_tokens = torch.bincount(packed.loss_seq, minlength=len(rollouts))
    our_loss = (terms.loss * ours.loss.token_weights(packed.loss_seq, seq_tokens, counts)).sum()
    our_loss.backward()

    config = GRPOConfig(
        output_dir=str(tmp_path), loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28,
        num_generations=G, per_device_train_batch_size=len(rollouts), max_completion_length=MAX_NEW,
        temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False,  # fp32 on both sides
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=is_cap or 3.0,
        use_bias_correction_kl=kl_correction,
    )
    trainer = GRPOTrainer(
        model=theirs_model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * len(rollouts)), processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    inputs = {**batch, "advantages": advantages, "num_items_in_batch": torch.tensor(float(tokens))}
    if old == "engine":
        inputs["old_per_token_logps"] = batch["sampling_per_token_logps"]
    if beta:
        inputs["ref_per_token_logps"] = ref_logprobs
    if is_cap is not None:
        # TRL applies this correction only with vLLM; the ratio itself is given as its generation step builds it.
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        inputs["importance_sampling_ratio"] = torch.exp(
            (trainer_logprobs - batch["sampling_per_token_logps"]) * batch["completion_mask"]
        ).clamp(max=is_cap)
    their_loss = trainer._compute_loss(trainer.model, inputs)
    their_loss.backward()

    if old == "engine":
        assert float(terms.low_clipped.sum() + terms.high_clipped.sum()) > 0, "the clipped branch must be exercised"
    _assert_same_loss_and_gradients(our_loss, ours.policy, their_loss, trainer.model)


def _assert_same_loss_and_gradients(our_loss, our_model, their_loss, their_model) -> None:
    torch.testing.assert_close(our_loss, their_loss.float(), rtol=1e-5, atol=1e-6)
    theirs = dict(their_model.named_parameters())
    compared = 0
    for name, param in our_model.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        compared += 1
    assert compared > 10


# -- every option of GRPOLoss --------------------------------------------------------------------------------

# Our GRPOLoss field -> TRL 1.16's GRPOConfig field. kl_estimator has none: TRL's KL estimate is k3, so the k1
# and k2 estimators are checked against their closed forms in test_grpo_loss.py instead.
TRL_NAMES = {
    "loss_type": "loss_type",
    "epsilon_low": "epsilon",
    "epsilon_high": "epsilon_high",
    "beta": "beta",
    "importance_sampling_cap": "vllm_importance_sampling_clip_max",
    "kl_bias_correction": "use_bias_correction_kl",
    "importance_sampling_level": "importance_sampling_level",
    "delta": "delta",
    "sapo_temperature_pos": "sapo_temperature_pos",
    "sapo_temperature_neg": "sapo_temperature_neg",
    "vespo_k_pos": "vespo_k_pos",
    "vespo_lambda_pos": "vespo_lambda_pos",
    "vespo_k_neg": "vespo_k_neg",
    "vespo_lambda_neg": "vespo_lambda_neg",
    "importance_sampling_mode": "vllm_importance_sampling_mode",
    "importance_sampling_floor": "vllm_importance_sampling_clip_min",
    "off_policy_mask_threshold": "off_policy_mask_threshold",
    "top_entropy_quantile": "top_entropy_quantile",
    "entropy_coef": "entropy_coef",
    "adaptive_entropy": "use_adaptive_entropy",
    "entropy_coef_min": "entropy_coef_min",
    "entropy_coef_max": "entropy_coef_max",
    "entropy_coef_delta": "entropy_coef_delta",
    "entropy_target": "entropy_target",
}


def test_every_loss_field_has_its_trl_counterpart():
    assert {f.name for f in dataclasses.fields(GRPOLoss)} - {"kl_estimator"} == set(TRL_NAMES)
    assert set(TRL_NAMES.values()) <= {f.name for f in dataclasses.fields(GRPOConfig)}


def test_every_loss_default_is_trls_but_the_correction_which_is_off_until_a_bound_is_set():
    """A TRL user who sets one field gets TRL's other ones (vllm_importance_sampling_mode is sequence_mask there)."""
    theirs = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    differ = {ours: (f.default, theirs[TRL_NAMES[ours]]) for f in dataclasses.fields(GRPOLoss) if (ours := f.name) in TRL_NAMES
              and f.default != theirs[TRL_NAMES[ours]]}  # fmt: skip
    assert differ == {"importance_sampling_cap": (None, 3.0)}  # docs/migrating_from_trl.md: vllm_importance_sampling_correction


def _trl_options(loss: GRPOLoss) -> dict:
    assert loss.kl_estimator == "k3", "TRL has no other KL estimator"
    options = {theirs: getattr(loss, ours) for ours, theirs in TRL_NAMES.items()}
    options["vllm_importance_sampling_correction"] = loss.corrects_engine
    return options


@pytest.fixture(scope="module")
def batch(model_path):
    """Rollouts whose engine log-probs are the trainer's plus noise (so the clip range, the engine-vs-trainer
    bounds and the off-policy mask all bite), padded for TRL and packed for us, with a reference model's
    log-probs and a pristine copy of the policy (TRL patches the model it is given; we switch ours to tree attention)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    module = GRPOModule(model_name_or_path=str(model_path), num_generations=G, sampling=SAMPLING)
    module.configure_model()
    pristine = copy.deepcopy(module.policy)
    reference = copy.deepcopy(module.policy)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    rollouts = _rollouts(len(tokenizer))
    trainer_logprobs = _unpacked_logprobs(pristine, padded_rollouts(rollouts, tokenizer.pad_token_id))
    noise = 0.4 * torch.randn(trainer_logprobs.shape, generator=gen)
    rollouts = [
        dataclasses.replace(r, logprobs=(trainer_logprobs[i] + noise[i])[: len(r.completion_ids)].tolist())
        for i, r in enumerate(rollouts)
    ]
    padded = padded_rollouts(rollouts, tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 1.2, -1.5])
    packed = module.pack_rollouts(rollouts, advantages)
    mask = padded["completion_mask"].bool()
    # Our terms come in the order of the padded batch's trained tokens, so a padded [B, T] tensor maps onto them by [mask].
    assert torch.equal(packed.loss_targets, padded["completion_ids"][mask])
    assert torch.equal(packed.loss_seq, mask.nonzero()[:, 0])
    return SimpleNamespace(
        tokenizer=tokenizer, module=module, pristine=pristine, padded=padded, packed=packed, mask=mask,
        advantages=advantages, trainer_logprobs=trainer_logprobs, ref_logprobs=_unpacked_logprobs(reference, padded),
        reference=reference,
    )  # fmt: skip


def _logprobs_and_entropy(module: GRPOModule, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Our packed forward, with the entropy differentiable (TRL's is; the entropy bonus needs its gradient)."""
    h = packed_hidden_states(module.policy, packed, attention_backend=module.attention_backend()).index_select(0, packed.loss_positions)
    weight, bias, transform = lm_head_of(module.policy, TEMPERATURE)
    assert transform == LogitTransform(temperature=TEMPERATURE)  # the tiny model: logits / temperature
    logprobs = token_logprobs(h, weight, packed.loss_targets, transform=transform, bias=bias)
    logp = torch.log_softmax(torch.nn.functional.linear(h, weight, bias).float() / TEMPERATURE, -1)
    return logprobs, -(logp.exp() * logp).sum(-1)


def _trl_engine_ratio(trainer: GRPOTrainer, padded: dict[str, torch.Tensor], old_logprobs: torch.Tensor) -> torch.Tensor:
    """TRL builds the engine-vs-trainer ratio in its generation step, which needs a model that generates: this runs
    that block of TRL's own source on our batch."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.rindex("\n", 0, source.index("# Compute the importance sampling ratio when using vLLM")) + 1
    end = source.index("# Compute the per-token log probabilities for the reference model")
    scope = {
        "self": trainer, "torch": torch, "math": math, "tool_mask": None, "completion_mask": padded["completion_mask"],
        "old_per_token_logps": old_logprobs, "sampling_per_token_logps": padded["sampling_per_token_logps"],
    }  # fmt: skip
    exec(textwrap.dedent(source[start:end]), scope)
    return scope["vllm_importance_sampling_ratio"]


def _control(options: dict) -> dict:
    """The case without its last option (a dapo loss in place of its loss type), which must give another loss or
    gradient on this batch: the option is exercised."""
    *rest, (key, value) = options.items()
    if key == "importance_sampling_mode":  # another mode (the default is one of them)
        return {**dict(rest), key: "token_mask" if value == "token_truncate" else "token_truncate"}
    return {**dict(rest), "loss_type": "dapo"} if key == "loss_type" else dict(rest)


IS = dict(importance_sampling_floor=0.8, importance_sampling_cap=1.3)
OPTION_CASES = [  # (GRPOLoss options, the last one the one the case is about; what the ratio is taken against)
    pytest.param(dict(epsilon_high=1.1, loss_type="cispo"), "engine", id="cispo"),
    pytest.param(dict(loss_type="sapo"), "engine", id="sapo"),
    pytest.param(dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=3.0), "engine", id="sapo-temperatures"),
    pytest.param(dict(importance_sampling_level="sequence", loss_type="luspo"), "engine", id="luspo"),
    pytest.param(dict(loss_type="vespo"), "engine", id="vespo"),
    pytest.param(dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=1.5, vespo_k_neg=2.0, vespo_lambda_neg=4.0),
                 "engine", id="vespo-parameters"),
    pytest.param(dict(loss_type="vespo", **IS, importance_sampling_mode="token_mask"), "trainer", id="vespo-engine-mask"),
    pytest.param(dict(loss_type="vespo", beta=0.05), "engine", id="vespo-kl"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence"), "engine", id="gspo"),
    pytest.param(dict(loss_type="sapo", importance_sampling_level="sequence"), "engine", id="sapo-sequence"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05), "engine", id="gspo-kl"),
    pytest.param(dict(loss_type="grpo", epsilon_low=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
                 "engine", id="gspo-clipped-sequences"),
    pytest.param(dict(loss_type="dapo", delta=1.35), "engine", id="dapo-two-sided"),
    pytest.param(dict(loss_type="dapo", delta=1.1), "engine", id="dapo-two-sided-inside-the-clip"),
    pytest.param(dict(loss_type="grpo", **IS), "trainer", id="grpo-engine-token-truncate"),
    pytest.param(dict(loss_type="bnpo", **IS, importance_sampling_mode="token_mask"), "trainer", id="bnpo-engine-token-mask"),
    pytest.param(dict(loss_type="dapo", **IS, importance_sampling_mode="sequence_truncate"), "trainer",
                 id="dapo-engine-sequence-truncate"),
    pytest.param(dict(loss_type="dr_grpo", **IS, importance_sampling_mode="sequence_mask"), "trainer",
                 id="dr_grpo-engine-sequence-mask"),
    pytest.param(dict(loss_type="dapo", off_policy_mask_threshold=0.05), "engine", id="dapo-off-policy-mask"),
    pytest.param(dict(loss_type="grpo", top_entropy_quantile=0.3), "engine", id="grpo-top-entropy"),
    pytest.param(dict(loss_type="dapo", entropy_coef=0.1), "engine", id="dapo-entropy-bonus"),
    pytest.param(dict(loss_type="sapo", top_entropy_quantile=0.3, entropy_coef=0.1), "engine", id="sapo-top-entropy-bonus"),
]


@pytest.mark.parametrize("options,old", OPTION_CASES)
def test_loss_options_match_trl(batch, tmp_path, options, old):
    options = {"epsilon_high": 0.28, **options}
    loss = GRPOLoss(**options)
    module, packed, mask = batch.module, batch.packed, batch.mask
    module.policy.zero_grad(set_to_none=True)

    logprobs, entropy = _logprobs_and_entropy(module, packed)
    engine = packed.token_values["engine_logprobs"]
    seq_tokens = torch.bincount(packed.loss_seq, minlength=packed.num_sequences)
    tokens = int(mask.sum())

    def step_loss(loss: GRPOLoss) -> torch.Tensor:
        terms = loss.token_loss(
            logprobs, logprobs.detach() if old == "trainer" else engine, batch.advantages[packed.loss_seq],
            ref_logprobs=batch.ref_logprobs[mask], engine_logprobs=engine, loss_seq=packed.loss_seq,
            seq_num_tokens=seq_tokens, entropy=entropy,
        )  # fmt: skip
        step_terms.append(terms)
        kept = None if terms.entropy_mask is None else int(terms.entropy_mask.sum())
        counts = StepCounts(num_sequences=packed.num_sequences, num_tokens=tokens, rank_tokens=tokens,
                            max_completion_length=MAX_NEW, entropy_tokens=kept)  # fmt: skip
        step_counts.append(counts)
        return loss.reduce(terms, packed.loss_seq, seq_tokens, counts)

    def value_and_slopes(value: torch.Tensor) -> torch.Tensor:
        slopes = torch.autograd.grad(value, [logprobs, entropy], retain_graph=True, allow_unused=True, materialize_grads=True)
        return torch.cat([value.detach()[None], *slopes])

    step_terms, step_counts = [], []
    control = value_and_slopes(step_loss(GRPOLoss(**_control(options))))
    our_loss = step_loss(loss)
    assert not torch.allclose(value_and_slopes(our_loss), control, rtol=1e-3, atol=1e-5), "the option must matter on this batch"
    our_loss.backward()

    theirs_model = copy.deepcopy(batch.pristine)
    config = GRPOConfig(
        output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=packed.num_sequences,
        max_completion_length=MAX_NEW, temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False, **_trl_options(loss),
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=theirs_model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * packed.num_sequences), processing_class=batch.tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    inputs = {**batch.padded, "advantages": batch.advantages, "num_items_in_batch": torch.tensor(float(tokens))}
    if old == "engine":
        inputs["old_per_token_logps"] = batch.padded["sampling_per_token_logps"]
    if loss.beta:
        inputs["ref_per_token_logps"] = batch.ref_logprobs
    if loss.corrects_engine:  # TRL corrects only the engine it knows, vLLM
        trainer.use_vllm = True
        inputs["importance_sampling_ratio"] = _trl_engine_ratio(trainer, batch.padded, batch.trainer_logprobs)
    their_loss = trainer._compute_loss(trainer.model, inputs)
    their_loss.backward()
    _assert_same_loss_and_gradients(our_loss, module.policy, their_loss, trainer.model)
    # What is logged under TRL's names is TRL's figure: the KL as the loss weighs it, and a clip fraction of
    # sequences at sequence level.
    stats = StepStats(clips=loss.clips, vespo=loss.loss_type == "vespo", policy_loss=loss.entropy_coef != 0)
    stats.add(our_loss, step_terms[-1], entropy, packed, bonus=loss.bonus(step_terms[-1], step_counts[-1]))
    ours, theirs = stats.metrics(), {name: values[-1] for name, values in trainer._metrics["train"].items()}
    names = (("kl", "kl"), ("entropy", "entropy"), ("clip_ratio/low_mean", "clip/low"), ("clip_ratio/high_mean", "clip/high"),
             ("clip_ratio/region_mean", "clip/fraction"), ("clip_ratio/low_min", "clip/low_min"), ("clip_ratio/high_max", "clip/high_max"),
             ("cispo_clip_ratio", "clip/high"), ("vespo/phi_seq_mean", "vespo/phi_seq_mean"), ("policy_loss", "policy_loss"))  # fmt: skip
    for their_name, our_name in names:
        if their_name in theirs:
            assert ours[our_name] == pytest.approx(theirs[their_name], rel=1e-5, abs=1e-7), our_name
    assert ("clip/low" in ours) == any(name.startswith(("clip_ratio/", "cispo_")) for name in theirs)  # none for sapo, vespo
    assert ("vespo/phi_seq_mean" in ours) == ("vespo/phi_seq_mean" in theirs)
    assert ("policy_loss" in ours) == ("policy_loss" in theirs)  # the loss without its entropy bonus, where one may apply

    # The module's own step with these options (its `loss:` group) gives the same loss and gradients: what a
    # recipe sets reaches the loss whole, sequences, entropy (differentiable) and the reference included.
    module.loss, module.hparams.old_logprobs = loss, old
    module.reference = batch.reference if loss.beta else None
    module.policy.zero_grad(set_to_none=True)
    terms, _ = module.row_loss(packed)
    kept = None if terms.entropy_mask is None else int(terms.entropy_mask.sum())
    counts = StepCounts(num_sequences=packed.num_sequences, num_tokens=tokens, rank_tokens=tokens,
                        max_completion_length=MAX_NEW, entropy_tokens=kept)  # fmt: skip
    module_loss = module.loss.reduce(terms, packed.loss_seq, seq_tokens, counts)
    module_loss.backward()
    _assert_same_loss_and_gradients(module_loss, module.policy, their_loss, trainer.model)


# -- advantages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "aggregation,scale",
    [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"), ("sum_then_normalize", "none"),
     ("normalize_then_sum", "group")],
)  # fmt: skip
def test_advantages_match_trl(aggregation, scale):
    """TRL builds its advantages inside its generation step: that block of its own source runs on our rewards."""
    from trl.trainer.utils import nanstd

    from lightning_rl.losses.advantages import group_advantages, normalize_then_sum

    gen = torch.Generator().manual_seed(3)
    per_function = torch.randn(4 * G, 3, generator=gen) * torch.tensor([1.0, 5.0, 0.2])
    per_function[:G, 1] = 2.0  # one reward tied within a group
    weights = torch.tensor([1.0, 0.5, 2.0])
    groups = torch.arange(4).repeat_interleave(G)
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.rindex("\n", 0, source.index('if self.multi_objective_aggregation == "sum_then_normalize":')) + 1
    end = source.index("# Unscorable completions")
    trainer = SimpleNamespace(multi_objective_aggregation=aggregation, scale_rewards=scale, reward_weights=weights,
                              reward_funcs=[None] * 3)  # fmt: skip
    scope = {"self": trainer, "torch": torch, "nanstd": nanstd, "rewards_per_func": per_function, "device": "cpu",
             "num_generations": G, "unscorable_mask": torch.zeros(4 * G, dtype=torch.bool)}  # fmt: skip
    exec(textwrap.dedent(source[start:end]), scope)
    if aggregation == "normalize_then_sum":
        ours = normalize_then_sum(per_function, weights, groups)
    else:
        ours = group_advantages((per_function * weights).sum(1), groups, scale)
    torch.testing.assert_close(ours, scope["advantages"], rtol=1e-5, atol=1e-6)
