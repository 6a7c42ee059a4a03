"""`lightning-rl plan`: counts from the real model classes, and the fit / refuse verdicts with their numbers."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForImageTextToText, MuseSparkConfig

from lightning_rl.planner import plan
from lightning_rl.planner.plan import LOCAL_CONFIGS
from lightning_rl.planner.memory_plan import GIB, Hardware, Training, plan_memory
from lightning_rl.planner.model_census import count_model
from slurm.tiny_muse import build_tiny_muse

MUSE_RECIPE = "recipes/muse_spark_open/lora_sft_8x8.yaml"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def muse_census():
    return count_model(AutoConfig.from_pretrained(LOCAL_CONFIGS / "meta-models" / "Muse-Spark-Open-816B-A42B"), ATTENTION)


@pytest.mark.parametrize("targets", [ATTENTION, "all-linear", r".*self_attn\.q_proj", ["self_attn.q_proj"]])
def test_counts_equal_the_instantiated_model_and_peft(tmp_path: Path, targets: list[str] | str) -> None:
    """Targets matched as peft matches them (names or dotted suffixes in a list, a regular expression in a string),
    the image-text model's towers left out unless they are adapted, and frozen in full fine-tuning: as a run loads it."""
    from lightning_rl.models.loading import outside_text_model

    folder = build_tiny_muse(tmp_path / "muse")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    outside = outside_text_model(model)
    assert outside is not None
    for towers in ("frozen", "lora"):
        census = count_model(model.config, targets, towers)
        assert census.total_params == sum(p.numel() for p in model.parameters())
        experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n and p.ndim == 3]
        assert census.expert_params == sum(p.numel() for p in experts) and census.num_experts == 4
        tower_params = sum(p.numel() for n, p in model.named_parameters() if re.match(outside, n))
        assert census.frozen_params == (tower_params if towers == "frozen" else 0) and tower_params > 0
        excluded = outside if towers == "frozen" else None
        peft_model = get_peft_model(AutoModelForImageTextToText.from_pretrained(folder), LoraConfig(r=8, target_modules=targets, exclude_modules=excluded))
        trainable, _ = peft_model.get_nb_trainable_parameters()
        assert census.lora_params(8) == trainable > 0


def test_muse_spark_open_sizes_come_from_its_config_class(muse_census) -> None:
    config = MuseSparkConfig().text_config
    assert (config.num_hidden_layers, config.hidden_size, config.num_local_experts) == (62, 8192, 256)
    assert muse_census.decoder_layers == 62 and muse_census.experts_per_token == 8
    assert 816e9 <= muse_census.total_params <= 823e9  # 816B language model, plus vision and audio towers
    assert 42e9 <= muse_census.decoder_active_params <= 43e9  # "42B active"


def test_step_time_is_the_printed_flop_formula(muse_census) -> None:
    training = Training(nodes=8, gpus_per_node=8, tokens_per_micro_batch=8192, lora_rank=16, expert_parallel=8)
    hardware = Hardware(gpu_memory_gb=80, peak_tflops=989, mfu=0.3)
    result = plan_memory(muse_census, training, hardware)
    tokens = 64 * 8192
    assert result.tokens_per_step == tokens
    assert result.compute_seconds == pytest.approx(6 * muse_census.active_params * tokens / (64 * 989e12 * 0.3))
    assert result.step_seconds == max(result.compute_seconds, result.comm_seconds)
    without = plan_memory(muse_census, Training(**{**training.__dict__, "activation_checkpointing": False}), hardware)
    assert without.total_bytes - result.total_bytes == pytest.approx(
        result.activations_without_checkpointing - result.activations_with_checkpointing
    )


def _gib(text: str, label: str) -> float:
    return float(re.search(rf"{label}\s+([\d.]+) GiB", text).group(1))


def test_muse_lora_fits_on_64_h100_with_margin(capsys) -> None:
    # As written: the recipe's own `expert_parallel_size: 8`, no flag.
    code = plan.main([MUSE_RECIPE, "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert code == 0, out
    margin = float(re.search(r"FITS: .* margin ([\d.]+) GiB", out).group(1))
    assert margin >= 10
    assert _gib(out, "frozen weights, sharded") == pytest.approx(822.04e9 * 2 / 64 / GIB, abs=0.01)
    for line in ["LoRA r=16", "expert parallel 8", "activation checkpointing on", "tokens per step: 64 GPUs x 8192 tokens"]:
        assert line in out


def test_one_node_is_refused_with_the_numbers(capsys) -> None:
    code = plan.main([MUSE_RECIPE, "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert code == 1
    needed = float(re.search(r"DOES NOT FIT: needs ([\d.]+) GiB per GPU, 72.00 GiB usable", out).group(1))
    assert needed > 72 and _gib(out, "frozen weights, sharded") == pytest.approx(822.04e9 * 2 / 8 / GIB, abs=0.01)
    # The flags' layout is planned; the recipe's own (8 nodes) is said to differ, with the override that runs this one.
    assert "planned for --nodes 1; the recipe's `trainer.num_nodes: 8` differs: run it with --trainer.num_nodes=1" in out


def test_the_flag_overrides_the_recipe_and_plain_fsdp_is_refused(capsys) -> None:
    code = plan.main([MUSE_RECIPE, "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--expert-parallel", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "expert parallel 1" in out and "DOES NOT FIT" in out


def test_plain_fsdp_layers_are_too_big_to_gather(muse_census) -> None:
    training = Training(nodes=8, gpus_per_node=8, tokens_per_micro_batch=8192, lora_rank=16, expert_parallel=1)
    result = plan_memory(muse_census, training, Hardware(gpu_memory_gb=80))
    gathers = next(t for t in result.terms if t.name == "FSDP all-gather buffers")
    assert gathers.bytes / GIB > 45 and not result.fits


def test_bad_input_is_named(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: nobody/none}\ndata: {train_data: rows.jsonl, max_tokens: 64}\n")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"]) == 2
    assert "`model.model_name_or_path: nobody/none` has no config.json" in capsys.readouterr().err
    args = [MUSE_RECIPE, "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--expert-parallel", "3"]
    assert plan.main(args) == 2
    assert "expert parallel 3 must divide both the 256 experts and the 64 GPUs" in capsys.readouterr().err
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl}\n")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"]) == 0  # run's default
    assert "1 GPUs x 2048 tokens x 1 accumulation" in capsys.readouterr().out
    recipe.write_text("task: grpo\nmodel: {model_name_or_path: tiny}\n")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"]) == 2
    err = capsys.readouterr().err
    assert "`model.max_tokens_per_row` is null: each step is forwarded in one row" in err
    assert "8 x 8 x (the longest prompt + its max_new_tokens) tokens at most" in err  # the module's defaults, as run reads them
    overrides = ["--", "--model.max_tokens_per_row=512", "--model.lora={r: 8}"]  # as run reads them
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", *overrides]) == 0
    out = capsys.readouterr().out
    assert "1 GPUs x 512 tokens x 1 accumulation" in out and "LoRA r=8" in out


def test_a_strategy_the_plan_does_not_model_is_refused(tmp_path: Path, capsys) -> None:
    """The plan is FSDP2's: DDP (Lightning's auto on several GPUs) keeps weights, gradients and Adam states whole on
    every GPU, and layers kept gathered hold far more; both were planned as sharded."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl, max_tokens: 256}\n")
    args = [str(recipe), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80", "--"]
    for strategy in ("ddp", "auto"):
        assert plan.main([*args, f"--trainer.strategy={strategy}"]) == 2
        assert f"`trainer.strategy: {strategy}`: the plan models FSDP2" in capsys.readouterr().err
    for fsdp2 in ("fsdp2", "FSDP2", "fsdp2_rocm"):  # any case, as Lightning reads a name; ROCm's is FSDP2's subclass
        assert plan.main([*args, f"--trainer.strategy={fsdp2}"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    kept = ["--trainer.strategy=lightning_rl.strategies.fsdp2.FSDP2Strategy", "--trainer.strategy.reshard_after_forward=false"]
    assert plan.main([*args, *kept]) == 2
    assert "`trainer.strategy.reshard_after_forward: false` keeps every decoder layer gathered" in capsys.readouterr().err
    assert plan.main([*args[:4], "1", *args[5:], "--trainer.strategy=auto"]) == 0  # one GPU: nothing to shard
    assert "FSDP" not in capsys.readouterr().out  # nor any buffer to gather into: they were counted
    assert plan.main([*args[:4], "1", *args[5:], "--trainer.strategy=fsdp2"]) == 0
    assert "FSDP all-gather buffers" in capsys.readouterr().out


def test_a_static_shape_strategy_is_planned_at_the_padded_row_and_an_unknown_name_refused(tmp_path: Path, capsys) -> None:
    """Rows padded to a multiple of 128 under a static-shape strategy (or of any integer given) were planned at
    data.max_tokens; a misspelt strategy was planned as auto, and XLA on several devices was told to use fsdp2."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl, max_tokens: 200}\n")
    args = [str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--"]
    for overrides, row in ((["--trainer.strategy=xla_static"], 256), (["--trainer.strategy=cpu_static"], 256),
                           (["--data.pad_to_multiple_of=64"], 256), ([], 200)):  # fmt: skip
        assert plan.main([*args, *overrides]) == 0
        out = capsys.readouterr().out
        assert f"1 GPUs x {row} tokens x 1 accumulation = {row}" in out and f"2 layers' {row} tokens" in out
        assert ("200 tokens planned as 256" in out) == (row == 256)
        assert ("runs attention dense (docs/neuron.md)" in out) == ("static" in " ".join(overrides))
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("task: grpo\nmodel: {model_name_or_path: tiny, max_tokens_per_row: 300}\ntrainer: {max_steps: 2, strategy: neuron}\n")
    assert plan.main([str(grpo), *args[1:]]) == 0
    assert "1 GPUs x 384 tokens" in capsys.readouterr().out  # GRPO pads the rows it packs as auto does
    assert plan.main([*args, "--trainer.strategy=cpu_statc"]) == 2
    assert capsys.readouterr().err == ("error: trainer.strategy=cpu_statc is neither a registered strategy name nor a Strategy "
                                       "class: did you mean 'cpu_static'?\n")
    assert plan.main([*args[:4], "8", *args[5:], "--trainer.strategy=xla_static"]) == 2
    assert "`trainer.strategy: xla_static`: an XLA/Neuron layout on several devices is not planned" in capsys.readouterr().err


def test_the_planner_takes_exactly_the_precisions_run_takes(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl, max_tokens: 256}\n")
    args = [str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--"]
    for short, full in (("bf16", "bf16-mixed"), ("16", "16-mixed"), ("32", "32-true"), ("64", "64-true")):
        assert plan.main([*args, f"--trainer.precision={short}"]) == 0
        assert capsys.readouterr().out == (plan.main([*args, f"--trainer.precision={full}"]), capsys.readouterr().out)[1]
    assert plan.main([*args, "--trainer.precision=16-true"]) == 2  # run refuses it too
    assert "trainer.precision must be one of 32-true, bf16-mixed, 16-mixed, bf16-true, 64-true, got '16-true'" in capsys.readouterr().err


def test_the_planner_finds_its_model_configs_from_any_working_directory(tmp_path: Path, capsys, monkeypatch) -> None:
    """The checked-in configs are package data, not files beside the working directory."""
    monkeypatch.chdir(tmp_path)
    code = plan.main([str(Path(__file__).resolve().parents[1] / MUSE_RECIPE), "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80"])
    assert code == 0, capsys.readouterr()
    assert "FITS" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", None])
def test_the_embedded_models_are_planned_as_run_finds_them(tmp_path: Path, capsys, caplog, model: str | None) -> None:
    """`tiny`, `tiny-moe` (and a recipe that names no model: run's default, tiny) are the models run builds; planning
    one seeds nothing and says nothing about it."""
    from transformers import AutoModelForCausalLM

    from lightning_rl.models.paths import resolve_model_path

    recipe = tmp_path / "r.yaml"
    written = "" if model is None else f"model: {{model_name_or_path: {model}}}\n"
    recipe.write_text(f"task: sft\n{written}data: {{train_data: rows.jsonl, max_tokens: 256}}\n")
    with caplog.at_level(logging.INFO):
        assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr()
    built = AutoModelForCausalLM.from_pretrained(resolve_model_path(model or "tiny"))
    assert f"{type(built).__name__}: {sum(p.numel() for p in built.parameters()) / 1e3:.2f}K parameters" in out.out
    assert "Seed set" not in caplog.text + out.err + out.out


def test_a_grpo_plan_counts_what_shares_the_trainers_gpu(tmp_path: Path, capsys) -> None:
    """A GRPO plan counted training alone: a colocated vLLM engine told to take 90% of the GPU and a reference model
    were said to fit beside it, with the same margin."""
    import inspect

    from lightning_rl.planner.plan import VLLM_DEFAULT_SHARE
    from lightning_rl.rollout.vllm_engine import VLLMEngine

    assert inspect.signature(VLLMEngine).parameters["gpu_memory_utilization"].default == VLLM_DEFAULT_SHARE
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: grpo\nmodel: {model_name_or_path: tiny, max_tokens_per_row: 512}\ntrainer: {max_steps: 2}\n")

    def planned(*overrides: str) -> tuple[int, dict[str, float], str]:
        code = plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--", *overrides])
        out = capsys.readouterr().out
        terms = {m[1]: float(m[2]) for m in re.finditer(r"^  (\S.*?)\s+([\d.]+) GiB", out, re.MULTILINE)}
        return code, terms, out

    code, alone, out = planned()
    assert code == 0 and "reference model" not in out and "generation time is not modelled" in out
    code, shared, out = planned("--model.loss.beta=0.1", "--model.engine=VLLMEngine", "--model.engine.init_args.gpu_memory_utilization=0.9")
    assert code == 1 and "DOES NOT FIT" in out
    assert shared["colocated vLLM engine (model.engine)"] == pytest.approx(0.9 * 80, abs=0.01)
    assert "reference model (model.loss.beta != 0)" in shared and shared["total"] >= alone["total"] + 71.99
    code, _, out = planned("--model.loss.beta=0.1", "--model.lora.r=8")
    assert code == 0 and "reference model" not in out  # LoRA's reference is the policy's base: its adapters off


def test_each_term_is_counted_in_the_dtype_the_run_holds_it_in(tmp_path: Path, capsys) -> None:
    """bf16-mixed keeps weights and the layers' inputs in float32 (FSDP2 gathers float32 without its mixed_precision);
    the transformers engine holds a whole copy of its own beside the policy; the reference's root stays gathered; a
    vLLM engine's dtype is its own."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: grpo\nmodel: {model_name_or_path: tiny, max_tokens_per_row: 512}\n"
                      "trainer: {max_steps: 2, strategy: fsdp2, precision: bf16-mixed}\n")  # fmt: skip

    def formulas(*overrides: str) -> dict[str, str]:
        plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80", "--", *overrides])
        return {m[1]: m[2] for m in re.finditer(r"^  (\S.*?)\s+[\d.]+ GiB\s+(.*)$", capsys.readouterr().out, re.MULTILINE)}

    mixed = formulas()
    assert mixed["FSDP root unit, gathered for the step"].endswith("x 4 B") and mixed["activations (no checkpointing)"].endswith("x 4 B")
    assert mixed["transformers engine's own copy (model.engine)"].startswith("its weights (") and " x 4 B)" in mixed["transformers engine's own copy (model.engine)"]
    gathered_in_bf16 = formulas("--trainer.strategy={class_path: lightning_rl.strategies.fsdp2.FSDP2Strategy, init_args: {mixed_precision: bf16}}")
    assert gathered_in_bf16["FSDP root unit, gathered for the step"].endswith("x 2 B") and gathered_in_bf16["activations (no checkpointing)"].endswith("x 4 B")
    beside = formulas("--model.loss.beta=0.1", "--model.engine={class_path: VLLMEngine, init_args: {dtype: float32, kv_cache_memory_bytes: 1000000}}")
    assert "transformers engine" not in " ".join(beside) and " x 4 B) + kv_cache_memory_bytes" in beside["colocated vLLM engine (model.engine)"]
    assert beside["reference model (model.loss.beta != 0)"].endswith("x 4 B, gathered")
    on_cpu = formulas("--model.engine={class_path: HFRolloutEngine, init_args: {device: cpu}}")
    assert "transformers engine's own copy (model.engine)" not in on_cpu
    # fp32's policy gathers in the weights' own dtype (it was counted 4 B under bf16-true); a MixedPrecisionPolicy by
    # class_path (a crash) gathers in its param_dtype; shard units of the recipe's own are refused (they were ignored).
    strategy = "--trainer.strategy={class_path: lightning_rl.strategies.fsdp2.FSDP2Strategy, init_args: {mixed_precision: %s}}"
    assert formulas("--trainer.precision=bf16-true", strategy % "fp32") == formulas("--trainer.precision=bf16-true", strategy % "null")
    policy = "{class_path: torch.distributed.fsdp.MixedPrecisionPolicy, init_args: {param_dtype: torch.float16}}"
    assert formulas(strategy % policy)["FSDP root unit, gathered for the step"].endswith("x 2 B")
    assert formulas(strategy % "{class_path: torch.distributed.fsdp.MixedPrecisionPolicy}")["FSDP root unit, gathered for the step"].endswith("x 4 B")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80", "--",
                      "--trainer.strategy=lightning_rl.strategies.fsdp2.FSDP2Strategy", "--trainer.strategy.layer_classes=[Qwen3MLP]"]) == 2
    assert "`trainer.strategy.layer_classes` chooses the shard units, which the plan takes from the model" in capsys.readouterr().err


def _tiny(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return CONFIG_MAPPING[model_type](**{**sizes, **overrides})


@pytest.mark.parametrize("model_type,extra", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # grouped experts and a router adapted too
    ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),  # Conv1D layers
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["sliding_attention", "full_attention"])),
])  # fmt: skip
def test_families_are_counted_as_peft_adapts_the_model_a_run_trains(model_type: str, extra: dict) -> None:
    """LoRA's trainable count was 7K for a MoE whose run trains 62K, and 0 for GPT-2; gpt-oss's expert biases crashed."""
    config = _tiny(model_type, **extra)
    census = count_model(config, "all-linear")
    model = get_peft_model(load_causal_lm_from_config(config), LoraConfig(r=8, target_modules="all-linear"))
    trainable, _ = model.get_nb_trainable_parameters()
    assert census.lora_params(8) == trainable > 0
    assert census.activation_elements_per_token_layer > 0 and all(unit.params > 0 for unit in census.units)


def test_tokens_travel_to_the_experts_at_the_width_fed_to_them(muse_census) -> None:
    """The all-to-all buffers were sized at the experts' intermediate width (768 for Qwen3-30B-A3B's 2048-wide tokens)."""
    qwen = count_model(_tiny("qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8))
    layer_types = ["sliding_attention", "full_attention"]  # gpt-oss stores its experts (experts, in, out)
    gpt_oss = count_model(_tiny("gpt_oss", intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=layer_types))
    # Llama 4 stores gate_up_proj (experts, hidden, 2 x intermediate): its tokens were counted 16 wide, not 32.
    llama4 = count_model(_tiny("llama4_text", intermediate_size=8, num_local_experts=4, num_experts_per_tok=1, head_dim=8))
    assert qwen.routed_width == gpt_oss.routed_width == llama4.routed_width == 32
    assert muse_census.routed_width == 4096  # its pre_expert_proj takes the 8192-wide hidden state to the experts' 4096
    training = Training(nodes=1, gpus_per_node=2, tokens_per_micro_batch=64, expert_parallel=2)
    buffers = next(t for t in plan_memory(qwen, training, Hardware(gpu_memory_gb=80)).terms if t.name == "expert all-to-all buffers")
    assert buffers.formula == "send+recv x 64 tokens x top-2 x 32 x 2 B"


def test_experts_are_read_from_a_sub_config_and_from_weights_that_fold_them_into_their_rows() -> None:
    """DBRX keeps its expert counts in ffn_config and each layer's experts in (experts * ffn_hidden_size, d_model)
    weights: it was counted 1 of 1 experts, every parameter active, and expert parallelism refused."""
    from transformers import CONFIG_MAPPING

    # transformers' DbrxAttention reads a rope_theta its attention config does not set by itself.
    dbrx = CONFIG_MAPPING["dbrx"](d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=64, attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                                  ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))  # fmt: skip
    census = count_model(dbrx)
    experts = 2 * 3 * 4 * 16 * 32  # two layers' w1, v1 and w2, (4 x 16, 32) each
    assert (census.num_experts, census.experts_per_token, census.expert_params) == (4, 2, experts)
    assert all(unit.expert_params == experts // 2 for unit in census.units)
    # Embeddings and final norm are not passed through; half of the experts (top-2 of 4) are.
    assert census.active_params == census.total_params - 64 * 32 - 32 - experts // 2
    # Wqkv 32+64, out_proj 32+32, router 32+4, two norms 32 each, and top-2 of w1, v1, w2 at 16+32 each.
    assert census.activation_elements_per_token_layer == 260 + 2 * 3 * (16 + 32)
    assert census.routed_width == 32
    # Aria names its top-k moe_topk, which its config maps to no common name.
    aria = count_model(_tiny("aria_text", moe_num_experts=4, moe_topk=2, moe_intermediate_size=16, head_dim=8))
    assert (aria.num_experts, aria.experts_per_token) == (4, 2)


@pytest.mark.parametrize("model_type,extra", [
    ("zamba", dict(num_hidden_layers=5, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, mamba_d_state=4)),
    ("zamba2", dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_hidden_layers=4, mamba_d_state=4, n_mamba_heads=8)),
])  # fmt: skip
def test_a_block_several_units_hold_is_counted_once_in_the_model_and_gathered_with_each(model_type: str, extra: dict) -> None:
    """Zamba's shared transformer block is inside every hybrid layer: the root unit came out negative."""
    from lightning_rl.planner.model_census import build_on_meta

    config = _tiny(model_type, **extra)
    census = count_model(config)
    assert census.root_params == 64 * 32 + 32  # the embeddings (tied to the LM head) and the final norm
    assert census.total_params == census.root_params + census.unit_params
    # FSDP2 manages a shared parameter in each unit that holds it, so each hybrid unit gathers the block.
    first, *others = [layer for layer in build_on_meta(config).model.layers if hasattr(layer, "mamba_decoder") or hasattr(layer, "shared_transf")]
    shared = sum(p.numel() for p in first.parameters() if any(p is q for q in others[0].parameters()))
    assert shared > 0 and sum(unit.params for unit in census.units) == census.unit_params + len(others) * shared


@pytest.mark.parametrize("model_type,mixed,moe,extra", [
    ("deepseek_v3", dict(first_k_dense_replace=1), dict(first_k_dense_replace=0),
     dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
          qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)),
    ("llama4_text", dict(interleave_moe_layer_step=2), dict(interleave_moe_layer_step=1),
     dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, intermediate_size_mlp=24, head_dim=8)),
])  # fmt: skip
def test_a_moe_whose_first_layers_are_dense_is_counted_layer_by_layer(model_type: str, mixed: dict, moe: dict, extra: dict) -> None:
    """A dense first layer (DeepSeek-V3's first_k_dense_replace, Llama 4's interleaved MoE layers) stood for every
    layer's activations, which its MoE layers outgrow."""
    census = count_model(_tiny(model_type, **mixed, **extra))
    all_moe = count_model(_tiny(model_type, **moe, **extra))
    dense_layer = census.activation_elements_per_token - all_moe.activation_elements_per_token_layer
    assert census.activation_elements_per_token_layer == all_moe.activation_elements_per_token_layer > dense_layer > 0
    assert all_moe.activation_elements_per_token == 2 * all_moe.activation_elements_per_token_layer
    training = Training(nodes=1, gpus_per_node=1, tokens_per_micro_batch=64, activation_checkpointing=False)
    kept = next(t for t in plan_memory(census, training, Hardware(gpu_memory_gb=80)).terms if t.name.startswith("activations"))
    assert kept.bytes == 64 * census.activation_elements_per_token * 2 and kept.formula == f"2 layers' 64 tokens x {census.activation_elements_per_token} x 2 B"


def test_an_lm_head_chunk_holds_at_most_the_rows_tokens() -> None:
    """A 512-token row was counted as a full chunk of 1024 tokens' logits."""
    census = count_model(_tiny("qwen3", head_dim=8))
    training = Training(nodes=1, gpus_per_node=1, tokens_per_micro_batch=512, logits_chunk=1024)
    head = next(t for t in plan_memory(census, training, Hardware(gpu_memory_gb=80)).terms if t.name == "chunked LM head")
    assert head.bytes == 3 * 512 * 64 * 4 and "3 x 512 tokens" in head.formula


def load_causal_lm_from_config(config):
    from lightning_rl.models.structure import auto_model_class

    return auto_model_class(config).from_config(config)


def test_census_takes_the_text_decoder_the_outermost_units_and_per_layer_top_k_and_refuses_what_run_refuses() -> None:
    from transformers import LlavaConfig

    from lightning_rl.errors import UserError

    # A vision tower deeper and heavier than the text decoder: the decoder's layers are counted, not the tower's.
    text = _tiny("qwen2", num_hidden_layers=2)
    vision = _tiny("siglip_vision_model", hidden_size=64, intermediate_size=256, num_hidden_layers=5, image_size=32, patch_size=8)
    llava = count_model(LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=63))
    assert llava.decoder_layers == 2
    # Mamba lists its block and the mixer inside it: one unit per block, and a root unit of the embeddings and head.
    mamba = count_model(_tiny("mamba", state_size=4, expand=2, conv_kernel=2))
    assert len(mamba.units) == 2 and mamba.root_params > 0
    assert mamba.total_params == mamba.root_params + sum(unit.params for unit in mamba.units)
    # Hunyuan's MoE gives its top-k per layer (a list): it crashed the census.
    hunyuan = count_model(_tiny("hunyuan_v1_moe", num_experts=4, moe_topk=[2, 2], head_dim=8))
    assert hunyuan.experts_per_token == 2
    with pytest.raises(UserError, match=r"\(t5\) is not a causal language model"):  # run refuses it; plan planned it
        count_model(_tiny("t5", d_model=32, d_ff=48, num_layers=2, num_heads=4, d_kv=8))
    with pytest.raises(UserError, match=r"lora.target_modules: 'q_proj' matches no module of GPT2LMHeadModel \(its linear layers: c_attn"):
        count_model(_tiny("gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64), ["q_proj"])
    # One module's name, as a run reads it (a list of it), not a pattern that matches nothing: it was refused here.
    assert plan.main(["recipes/tiny/sft_lora.yaml", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--",
                      "--model.lora.target_modules=q_proj"]) == 0  # fmt: skip
    falcon_h1 = _tiny("falcon_h1", head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8)
    with pytest.raises(UserError, match=r"lora.target_modules: peft cannot adapt FalconH1ForCausalLM as asked: .*out_proj"):
        count_model(falcon_h1, "all-linear")  # a run met it as peft's traceback


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_lora_adapters_are_counted_in_the_dtype_the_precision_gives_them(tmp_path: Path, precision: str) -> None:
    """Lightning's precision converts the model after peft adds the adapters: the plan counts their bytes as stored."""
    from lightning.pytorch.plugins.precision import HalfPrecision, Precision
    from support.tiny_models import llama

    converter = HalfPrecision(precision) if precision == "bf16-true" else Precision()
    model = converter.convert_module(get_peft_model(llama(), LoraConfig(r=4, target_modules=ATTENTION)))
    stored = {p.dtype.itemsize for p in model.parameters() if p.requires_grad}
    param_bytes, _ = plan._PRECISION_BYTES[precision]
    assert stored == {param_bytes}
    result = plan_memory(count_model(model.config, ATTENTION), Training(nodes=1, gpus_per_node=1, tokens_per_micro_batch=64, lora_rank=4, param_bytes=param_bytes), Hardware(gpu_memory_gb=80))
    assert f"x {param_bytes} B" in next(t for t in result.terms if t.name == "trainable weights, sharded").formula


def test_an_sft_batch_cut_into_rows_is_planned_at_its_row(tmp_path: Path, capsys) -> None:
    """A row, not the batch, is what a forward holds (``data.max_tokens_per_row``); a step takes the batch's rows.
    Several GPUs are refused, as the run refuses them under FSDP2 (the plan models no other strategy on several)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: sft\nmodel: {model_name_or_path: tiny}\ndata: {train_data: rows.jsonl, max_tokens: 256, max_tokens_per_row: 64}\n")
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80"]) == 0
    assert "1 GPUs x 256 tokens (rows of 64) x 1 accumulation = 256" in capsys.readouterr().out
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--tokens-per-micro-batch", "100"]) == 0
    assert "1 GPUs x 256 tokens (rows of 100) x 1 accumulation = 256" in capsys.readouterr().out  # a row that does not divide the batch
    assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80", "--tokens-per-micro-batch", "512"]) == 2
    assert "no row is larger than its batch" in capsys.readouterr().err
    for given in ([], ["--tokens-per-micro-batch", "64"]):
        assert plan.main([str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80", *given]) == 2
        assert "`data.max_tokens_per_row` cuts each batch into rows, which several processes run under DDP alone" in capsys.readouterr().err
