"""Static-shape discipline of the XLA/Neuron strategies, proven with the compile-count stand-in.

No XLA or Neuron device can run here (torch_xla does not install beside this torch), so the real
strategies are untested on hardware. ``cpu_static`` applies their shape policy on a CPU and compiles the
model with ``dynamic=False``, which recompiles on every new input shape as XLA does; a counting backend
turns compiles into a number. A training step packs rows with the packing core, padded by
``resolve_pad_to_multiple_of(..., trainer)``, and scores every position (a data-independent shape).
The same count holds for the model's forward inside ``packed_logprobs`` (the SFT/GRPO path) once tree attention
takes its shape-only backend, which ``choose_backend`` picks wherever shapes must be static. (Only the model is
compiled here: the loss over the trained tokens, whose count varies by row, is not counted; docs/neuron.md.)
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from lightning_rl.attention.tree_attention import choose_backend
from lightning_rl.ops.packed_forward import packed_logprobs
from lightning_rl.packing.tree import pack_sequences
from lightning_rl.device_policy import requires_static_shapes, resolve_pad_to_multiple_of
from lightning_rl.strategies import StaticShapeCPUStrategy

LENGTHS = [9, 40, 71, 130, 200]  # five distinct lengths, two 128-buckets


class CompileCounter:
    """A torch.compile backend that runs the captured graph eagerly and counts how often it was asked."""

    def __init__(self) -> None:
        self.compiles = 0
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Tensor]) -> object:
        self.compiles += 1
        self.shapes.append(next((tuple(t.shape) for t in example_inputs if isinstance(t, Tensor) and t.ndim == 2), ()))
        return graph.forward


class PackedLMModule(L.LightningModule):
    """One packed row per step.

    ``all_positions`` runs the model's own causal attention and scores every position, so no shape
    depends on the data; ``packed_logprobs`` is the SFT/GRPO path (tree attention, trained tokens only).
    """

    def __init__(self, folder: Path, pad_to_multiple_of: int | str | None, scoring: str = "all_positions") -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.scoring = scoring
        self.row_lengths: list[int] = []

    def training_step(self, batch: list[list[int]], batch_idx: int) -> Tensor:
        multiple = resolve_pad_to_multiple_of(self.pad_to_multiple_of, self.trainer)
        row = pack_sequences(batch, share_prefixes=False, pad_to_multiple_of=multiple)
        self.row_lengths.append(row.input_ids.numel())
        if self.scoring == "packed_logprobs":
            backend = choose_backend("auto", self.device, static_shapes=requires_static_shapes(self.trainer))
            return -packed_logprobs(self.model, row, attention_backend=backend).mean()
        targets = torch.full_like(row.input_ids, -100)
        targets[row.loss_positions] = row.loss_targets
        logits = self.model(input_ids=row.input_ids[None], position_ids=row.position_ids[None]).logits
        return torch.nn.functional.cross_entropy(logits[0].float(), targets, ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-static")
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_hidden_layers=1,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def train_and_count(
    folder: Path, pad_to_multiple_of: int | str | None, scoring: str = "all_positions", lengths: list[int] = LENGTHS
) -> tuple[CompileCounter, PackedLMModule]:
    torch._dynamo.reset()
    counter = CompileCounter()
    module = PackedLMModule(folder, pad_to_multiple_of, scoring)
    generator = torch.Generator().manual_seed(0)
    # Each batch is one sequence; every length is seen twice, so only new shapes may compile.
    batches = [[torch.randint(1, 64, (n,), generator=generator).tolist()] for n in lengths * 2]
    data = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer = L.Trainer(
        strategy=StaticShapeCPUStrategy(compile_backend=counter), max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, data)
    return counter, module


def test_auto_padding_compiles_once_per_bucket_where_unpadded_compiles_per_length(tiny_model: Path) -> None:
    unpadded, module = train_and_count(tiny_model, None)
    assert sorted(set(module.row_lengths)) == LENGTHS
    assert len(set(unpadded.shapes)) == len(LENGTHS)
    graphs_per_shape = unpadded.compiles // len(LENGTHS)
    assert graphs_per_shape >= 1 and unpadded.compiles == graphs_per_shape * len(LENGTHS)

    padded, module = train_and_count(tiny_model, "auto")
    buckets = math.ceil(max(LENGTHS) / 128)
    assert sorted(set(module.row_lengths)) == [128, 256]
    assert len(set(padded.shapes)) <= buckets
    assert padded.compiles <= buckets * graphs_per_shape


def test_packed_logprobs_step_compiles_once_per_bucket(tiny_model: Path) -> None:
    lengths = [9, 71, 130, 200]
    counter, module = train_and_count(tiny_model, "auto", scoring="packed_logprobs", lengths=lengths)
    assert sorted(set(module.row_lengths)) == [128, 256]
    # The packing probe adds two graphs, once: its packed row in eval mode without gradients and its per-sequence
    # reference, both padded to the 128 bucket, so it brings no new shape.
    probe_graphs = 2
    assert counter.compiles <= math.ceil(max(lengths) / 128) + probe_graphs
    assert {shape[-1] for shape in counter.shapes} == {128, 256}


def test_auto_resolves_by_strategy_and_device() -> None:
    assert resolve_pad_to_multiple_of("auto", StaticShapeCPUStrategy()) == 128
    assert resolve_pad_to_multiple_of("auto", torch.device("xla", 0)) == 128
    assert resolve_pad_to_multiple_of("auto", "neuron:0") == 128
    assert resolve_pad_to_multiple_of("auto", torch.device("cpu")) is None
    assert resolve_pad_to_multiple_of("auto", L.Trainer(accelerator="cpu", logger=False)) is None
    assert resolve_pad_to_multiple_of(64, torch.device("cpu")) == 64
    assert resolve_pad_to_multiple_of(None, torch.device("xla")) is None
    assert requires_static_shapes(torch.device("xla")) and not requires_static_shapes(torch.device("cuda"))
    for bad in (0, -8, "128", 2.5, True):
        with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive int"):
            resolve_pad_to_multiple_of(bad, torch.device("cpu"))


def test_a_one_device_strategy_given_several_devices_is_refused_before_training(tiny_model: Path) -> None:
    """Lightning cut trainer.devices: 2 (or num_nodes: 2) to one device under cpu_static and neuron, silently: a trn1's
    32 NeuronCores would have trained on one."""
    from lightning_rl.errors import RecipeError

    for devices, nodes in ((2, 1), (1, 2)):
        module = PackedLMModule(tiny_model, "auto", "all_positions")
        trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=StaticShapeCPUStrategy(compile_backend="eager"),
                            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        with pytest.raises(RecipeError, match=rf"^strategy 'cpu_static' trains on one device, but trainer.devices asks for {devices} on {nodes} node"):
            trainer.fit(module, torch.utils.data.DataLoader([[[5, 6, 7]]], batch_size=None, collate_fn=lambda b: b))
        assert module.row_lengths == []  # no step ran
    # devices left at auto is the one device, whatever the machine holds (Lightning reads auto as every device).
    from types import SimpleNamespace

    from lightning_rl.strategies.xla import check_one_device

    asked = SimpleNamespace(_devices_flag="auto", _parallel_devices=[torch.device("cpu")] * 32, _num_nodes_flag=1)
    check_one_device(SimpleNamespace(_accelerator_connector=asked), "neuron")


def test_the_rehearsal_counts_every_shape_past_torchs_recompile_limit(tiny_model: Path) -> None:
    """torch runs a model eagerly, uncounted, after 8 shapes: the count stopped at 8 where it mattered most."""
    lengths = [5 + 9 * k for k in range(12)]
    counter, module = train_and_count(tiny_model, None, lengths=lengths)
    assert sorted(set(module.row_lengths)) == lengths and len(set(counter.shapes)) == len(lengths)


def test_grpo_rows_are_padded_to_buckets_on_a_static_shape_device(tmp_path: Path, monkeypatch) -> None:
    """GRPO packed its rows at their own length under every static-shape strategy: a graph per row length."""
    from lightning_rl import cli
    from lightning_rl.modules.grpo import GRPOModule
    from support.paths import REPO

    lengths, pack = [], GRPOModule.pack_rollouts
    monkeypatch.setattr(GRPOModule, "pack_rollouts", lambda self, *a: lengths.append((row := pack(self, *a)).input_ids.numel()) or row)
    code = cli.main([
        "run", str(REPO / "recipes" / "tiny" / "grpo.yaml"), "--trainer.enable_progress_bar=false", "--logger.kind=none",
        "--model.num_generations=2", "--data.batch_size=1", "--trainer.max_steps=2", "--model.eval_generations=0",
        f"--output_dir={tmp_path / 'run'}", "--trainer.strategy.class_path=lightning_rl.strategies.StaticShapeCPUStrategy",
        "--trainer.strategy.init_args.compile_backend=eager",
    ])  # fmt: skip
    assert code == 0 and lengths and all(n % 128 == 0 for n in lengths), lengths
