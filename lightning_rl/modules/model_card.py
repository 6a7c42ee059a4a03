"""The model card (README.md) of a run's Hugging Face export: what trained the model, from which base, on what data,
with which settings, and how to load it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The settings a card lists, by their recipe keys under ``model.``, when the module has them.
KEY_SETTINGS = (
    "learning_rate", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm", "num_generations", "loss.loss_type",
    "loss.beta", "loss.epsilon_low", "loss.epsilon_high", "sampling.temperature", "sampling.max_new_tokens", "seed",
)  # fmt: skip


def key_settings(hparams: Mapping[str, Any], lora: Any = None) -> dict[str, Any]:
    """The ``KEY_SETTINGS`` the module's hyperparameters hold, the LoRA settings and the reward functions, by key."""
    settings: dict[str, Any] = {}
    for key in KEY_SETTINGS:
        node: Any = hparams
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            settings[key] = node
    if lora is not None:
        settings.update({"lora.r": lora.r, "lora.alpha": lora.alpha, "lora.target_modules": lora.target_modules})
    rewards = hparams.get("rewards")
    if rewards:
        settings["rewards"] = ", ".join(f"{r['name'] or r['function']} (weight {r['weight']})" for r in rewards)
    return settings


def data_name(source: Any) -> str | None:
    """A data source as a card names it: a file or folder by its name (its folder on this machine says nothing
    elsewhere), anything else by its type."""
    if source is None:
        return None
    return Path(source).name if isinstance(source, (str, Path)) else type(source).__name__


def model_card(
    *, task: str, base_model: str, export: str, steps: int, data: str | None, settings: dict[str, Any], image_text: bool = False,
    embedded_base: bool = False, model_class: str | None = None,
) -> str:
    """The card's text: Hugging Face metadata (base model, library, tags), then what trained the model and how to load
    it: an image-text model (``image_text``: it has a processor) through its processor; the model through
    ``model_class``, the auto class its config loads with (by default the image-text one with a processor, else the
    causal-LM one); an adapter onto its base, which for a model lightning-rl builds itself (``embedded_base``: no hub
    id) lightning-rl gives."""
    adapter = export == "adapter"
    library = "peft" if adapter else "transformers"
    what = {"model": "the fully fine-tuned model", "merged": "the model with its LoRA adapter merged in", "adapter": "a LoRA adapter"}[export]
    on = f" on `{data}`" if data else ""
    rows = "".join(f"| `{key}` | `{value}` |\n" for key, value in settings.items())
    return (
        f"---\nbase_model: {base_model}\nlibrary_name: {library}\ntags:\n- lightning-rl\n- {task.lower()}\n"
        + ("- lora\n" if "lora.r" in settings else "")
        + f"---\n\n# {task} of {base_model}\n\n"
        f"Trained with lightning-rl: {task} of `{base_model}` for {steps} optimizer steps{on}. This folder holds {what}.\n\n"
        f"| setting (recipe key under `model.`) | value |\n|---|---|\n{rows}\n"
        f"Load it:\n\n```python\n{load_code(base_model, adapter, image_text, embedded_base, model_class)}\n```\n"
    )


def load_code(base_model: str, adapter: bool, image_text: bool, embedded_base: bool, model_class: str | None = None) -> str:
    """The Python that loads an export from ``FOLDER``: the model (an adapter onto its base) and its tokenizer or
    processor."""
    reader, name = ("AutoProcessor", "processor") if image_text else ("AutoTokenizer", "tokenizer")
    model_class = model_class or ("AutoModelForImageTextToText" if image_text else "AutoModelForCausalLM")
    lines = [*(["from peft import PeftModel"] if adapter else []), f"from transformers import {model_class}, {reader}"]
    if adapter and embedded_base:  # no hub id: lightning-rl builds the embedded model (cached) and gives its folder
        lines += ["from lightning_rl.models.paths import resolve_model_path", "", f"base = {model_class}.from_pretrained(resolve_model_path({base_model!r}))"]
    elif adapter:
        lines += ["", f"base = {model_class}.from_pretrained({base_model!r})"]
    else:
        lines += [""]
    lines += ["model = PeftModel.from_pretrained(base, FOLDER)" if adapter else f"model = {model_class}.from_pretrained(FOLDER)",
              f"{name} = {reader}.from_pretrained(FOLDER)"]  # fmt: skip
    return "\n".join(lines)
