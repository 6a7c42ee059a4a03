"""The one held-out evaluator of SFT and GRPO: each held-out conversation's prompt decoded greedily, and the share
whose reply equals the reference reply exactly (whitespace at the ends aside); each evaluation is logged."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from transformers import PreTrainedTokenizerBase

from lightning_rl.data.sft import DataError, DataSource, GenerationCase, Renderer, load_examples
from lightning_rl.errors import RecipeError
from lightning_rl.models.loading import generate_greedy

HELDOUT_METRIC = "val/exact_match"  # the held-out exact match, as the run's loggers have it
HELDOUT_BEFORE_METRIC = "val/exact_match_before"  # ... of the weights before the first step (summary.json's `_before`)


def heldout_cases(
    source: DataSource, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, processor: Any = None, image_token_id: int | None = None,
    *, count: int | None = None, context: int | None = None, max_new_tokens: int = 0,
    prompt_messages: Callable[[str], list[dict[str, Any]]] | None = None,
) -> list[GenerationCase]:
    """The first ``count`` held-out prompts and reference replies of an SFT-shaped file (its rows checked as SFT checks
    them; rows with images rendered by an image-text model's ``processor``). One whose prompt leaves no room for
    ``max_new_tokens`` in the model's ``context`` is refused, naming its row: its greedy reply would be decoded past
    the model's positions, and its score would mean nothing. ``prompt_messages``: the chat turns a string prompt is
    rendered as, where the tokenizer has a chat template (GRPO's, as it renders its training prompts; by default a
    string prompt is its text, as SFT trains it)."""
    def as_chat(row: dict) -> dict:
        if prompt_messages is None or not isinstance(row.get("prompt"), str) or not getattr(tokenizer, "chat_template", None):
            return row
        return {**row, "prompt": prompt_messages(row["prompt"]), "completion": [{"role": "assistant", "content": row["completion"]}]}

    _, cases = load_examples(source, Renderer(tokenizer, tokenizer_name, processor, image_token_id), max_length=1 << 30, as_chat=as_chat, key="model.eval_data")
    if not cases:
        raise RecipeError(f"eval_data ({source}) has no conversation ending in a reply: the held-out evaluation "
                          "(eval_generations) decodes the prompts of those and compares the replies", "eval_data")
    cases = cases[:count]
    check_cases_fit(cases, context, max_new_tokens, "eval_max_new_tokens")
    return cases


def check_cases_fit(cases: list[GenerationCase], context: int | None, max_new_tokens: int, key: str) -> None:
    """Refuse, naming its row, a held-out prompt that leaves no room for ``max_new_tokens`` (recipe key ``key``) in
    the model's ``context`` (None: no limit known): its greedy reply would be decoded past the model's positions."""
    for case in cases if context is not None else ():
        if len(case.prompt_ids) + max_new_tokens > context:
            raise DataError(f"{case.where}: the held-out prompt is {len(case.prompt_ids)} tokens; with {key}={max_new_tokens} "
                            f"it does not fit the model's context of {context} tokens: shorten it or lower {key}")


def exact_match(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cases: list[GenerationCase], *, max_new_tokens: int
) -> dict[str, Any]:
    """``heldout_exact_match`` (a fraction), ``heldout_examples`` and ``heldout_generation_seconds``."""
    start = time.perf_counter()
    texts = generate_greedy(model, tokenizer, [c.prompt_ids for c in cases], max_new_tokens=max_new_tokens, images=[c.images for c in cases])
    correct = sum(text.strip() == case.reference.strip() for text, case in zip(texts, cases, strict=True))
    return {
        "heldout_exact_match": correct / len(cases),
        "heldout_examples": len(cases),
        "heldout_generation_seconds": time.perf_counter() - start,
    }


def log_heldout(module: LightningModule, figures: dict[str, Any]) -> dict[str, Any]:
    """``figures`` (``exact_match``'s), after logging the held-out exact match to the run's loggers (CSV, W&B) at the
    step it follows, where Lightning logs that step's figures (one less than the steps taken): each evaluation is in
    the logs, not only the last in summary.json. Before any step, it is ``HELDOUT_BEFORE_METRIC`` at 0, which the
    first step's row holds too: under one name, W&B kept one of the two and a CSV row had two."""
    before = module.global_step == 0
    for logger in module.loggers:
        logger.log_metrics({HELDOUT_BEFORE_METRIC if before else HELDOUT_METRIC: figures["heldout_exact_match"]}, step=max(module.global_step - 1, 0))
    return figures


class HeldOutEvery(Callback):
    """GRPO's held-out evaluation every ``trainer.val_check_interval`` steps (a whole number; TRL's ``eval_steps``), on
    every rank, besides the one before training and the one at its end (summary.json). An interval with nothing to
    evaluate (``eval_generations`` 0) is refused: it would be taken without effect."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        interval = trainer.val_check_interval
        if isinstance(interval, int) and not pl_module.hparams.eval_generations:
            raise RecipeError(f"trainer.val_check_interval={interval}: a GRPO run evaluates held-out prompts (model.eval_data) only "
                              "with model.eval_generations set: set it, or leave val_check_interval out", "trainer.val_check_interval")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        interval, step = trainer.val_check_interval, trainer.global_step
        if isinstance(interval, int) and pl_module.hparams.eval_generations and step % interval == 0 and step < trainer.max_steps:
            pl_module.evaluate()  # the last step's is the run's final evaluation
