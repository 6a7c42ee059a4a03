"""Loading a causal LM (optionally with a LoRA adapter through peft), greedy decoding, and HF export."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.tensor import DTensor
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D

from lightning_rl import validation
from lightning_rl.disk_space import no_room, space_error, tensor_bytes
from lightning_rl.errors import RecipeError
from lightning_rl.packing.images import stack_images
from lightning_rl.models import sharded_loading
from lightning_rl.models.paths import resolve_model_path
from lightning_rl.models.multimodal import image_token_types
from lightning_rl.models.structure import auto_model_class, enable_activation_checkpointing
from lightning_rl.models.weights import iter_adapter_weights, iter_full_weights


@dataclass
class LoraSettings:
    """The ``lora:`` block of a recipe. ``target_modules`` is a list of module names or "all-linear"; every name must
    match modules of the model (checked when it loads).

    Args:
        r: the adapters' rank. TRL: `lora_r`.
        alpha: their scale is ``alpha / r``. TRL: `lora_alpha`.
        dropout: dropout on the adapters' input. TRL: `lora_dropout`.
        target_modules: the module names adapted (one name alone is a list of it), or ``all-linear``. TRL:
            `lora_target_modules`.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")

    @classmethod
    def checked(cls, lora: LoraSettings | dict | None) -> LoraSettings | None:
        """The block as settings (LightningCLI may hand it over as a mapping), its values checked."""
        if lora is None:
            return None
        lora = cls(**lora) if isinstance(lora, dict) else lora
        lora.check()
        return lora

    def check(self) -> None:
        validation.positive_int("lora.r", self.r)
        validation.finite_positive("lora.alpha", self.alpha)
        validation.fraction("lora.dropout", self.dropout)
        if not self.target_modules:
            raise RecipeError("lora.target_modules must name at least one module (or be all-linear)", "lora.target_modules")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self.target_modules = [self.target_modules]  # one module's name (peft would read it as a pattern)
        if isinstance(self.target_modules, list):
            validation.unique("lora.target_modules", self.target_modules)


# What an image-text model's towers (vision, audio, and their projectors into the text model) do in training.
TowerTraining = Literal["frozen", "train", "lora"]


def check_towers(towers: TowerTraining, lora: LoraSettings | None) -> None:
    """Refuse a ``towers`` setting that does not go with the fine-tuning (``lora`` or full)."""
    if towers not in ("frozen", "train", "lora"):
        raise RecipeError(f"towers must be one of frozen, train, lora, got {towers!r}", "towers")
    if towers == "lora" and lora is None:
        raise RecipeError("towers: lora puts LoRA adapters on the towers too, and needs a lora block", "towers")
    if towers == "train" and lora is not None:
        raise RecipeError("towers: train trains the towers in full, which LoRA fine-tuning does not; give them adapters (towers: lora) or keep them frozen", "towers")


def load_causal_lm(
    name_or_path: str, *, lora: LoraSettings | None = None, gradient_checkpointing: bool = False, defer_weights: bool = False,
    towers: TowerTraining = "frozen",
) -> torch.nn.Module:
    """The model in fp32 (precision is the Trainer's), adapted with LoRA when ``lora`` is given.

    Multimodal checkpoints whose text model has no causal-LM class of its own (Muse Spark Open, image-text models)
    load through their image-text-to-text class, which is a causal LM over text when given only ``input_ids``. Their
    towers are frozen by default; ``towers="train"`` trains them in full (full fine-tuning only), ``"lora"`` gives
    them adapters too (with ``lora``). Train them only on data that reaches them (images): a trainable weight that
    never gets a gradient has no optimizer state for a sharded checkpoint to restore.

    With ``defer_weights`` the model is built on the meta device and reads nothing yet: the FSDP2 strategy
    loads each rank's shards after sharding it (``lightning_rl.models.sharded_loading``)."""
    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    auto = auto_model_class(config)
    attention = causal_attention(auto, config)
    if defer_weights:
        with torch.device("meta"):
            model = auto.from_config(config, attn_implementation=attention, dtype=torch.float32)
        if (saved := saved_generation_config(path)) is not None:
            model.generation_config = saved
        sharded_loading.defer_weights(model, path)
    else:
        model = auto.from_pretrained(path, attn_implementation=attention, dtype=torch.float32)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    check_towers(towers, lora)
    outside = outside_text_model(model)
    if lora is None:
        for name, param in model.named_parameters():
            if towers == "frozen" and outside and re.match(outside, name):
                param.requires_grad_(False)
        return model
    _check_lora_targets(model, lora.target_modules)
    if towers == "frozen" and outside and lora.target_modules != "all-linear":
        # peft's exclude_modules leaves the towers without adapters: a name matching there alone adapted nothing.
        names = [name for name, _ in model.named_modules() if not re.match(outside, name)]
        if only := next((t for t in lora.target_modules if not any(name == t or name.endswith(f".{t}") for name in names)), None):
            raise RecipeError(
                f"lora.target_modules: {only!r} names modules of {type(model).__name__}'s towers alone, which towers: frozen "
                "leaves without adapters: set model.towers: lora to adapt them, or leave it out", "lora.target_modules",
            )  # fmt: skip
    if towers == "lora" and outside and lora.target_modules != "all-linear":
        names = [name for name, _ in model.named_modules()]
        if not any(re.match(outside, name) and any(name == t or name.endswith(f".{t}") for t in lora.target_modules) for name in names):
            leaves = sorted({name.rpartition(".")[2] for name, module in model.named_modules() if re.match(outside, name) and isinstance(module, torch.nn.Linear)})
            raise RecipeError(
                f"towers: lora, but lora.target_modules names no module of the towers of {type(model).__name__}, which would "
                f"train as if frozen (their linear layers: {', '.join(leaves)}; or all-linear)", "towers",
            )  # fmt: skip
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        exclude_modules=None if towers == "lora" else outside,
        task_type="CAUSAL_LM",
    )
    model = with_adapters(model, config)
    if not defer_weights:  # drawn as a sharded load draws them, so a run on one process starts where FSDP2's does
        sharded_loading.init_lora_factors(model, seed=torch.initial_seed() % 2**31)
    return model


@contextlib.contextmanager
def base_model(model: PeftModel) -> Iterator[PeftModel]:
    """``model`` as the base it was adapted from: its LoRA adapters off and in eval mode (no dropout), as a frozen
    copy of the base loaded beside it would run, without that copy's memory. Each module's mode is restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        for module, training in modes:
            module.training = training


def with_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """peft's model with LoRA adapters on ``model``; a module peft refuses to adapt (a Mamba mixer's ``out_proj``) is
    one line naming ``lora.target_modules``."""
    name, leaves = type(model).__name__, _linear_leaves(model)  # before peft, which rewrites the model in place as it fails
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        # peft names a module it cannot adapt by its repr, over many lines: its class name says it
        said = re.sub(r"Target module (\w+)\(.*?\) is not supported", r"Target module \1 is not supported", " ".join(str(error).split()))
        said = said.split(". Currently")[0].rstrip(".")
        if config.lora_dropout and "lora_dropout" in said:  # peft adapts a mixture of experts' expert weights (parameters, not layers) without dropout
            raise RecipeError(f"lora.dropout: peft cannot adapt {name} as asked with dropout {config.lora_dropout}: {said} (set "
                              f"lora.dropout: 0, or name in lora.target_modules only linear layers: {', '.join(leaves)})", "lora.dropout") from None
        raise RecipeError(f"lora.target_modules: peft cannot adapt {name} as asked: {said} (name the "
                          f"modules to adapt: its linear layers {', '.join(leaves)}; or all-linear)", "lora.target_modules") from None


def _linear_leaves(model: torch.nn.Module) -> list[str]:
    """The last names of ``model``'s linear layers, each once, but its output head's: what ``lora.target_modules``
    can name."""
    linear = (torch.nn.Linear, Conv1D)  # GPT-2's projections are Conv1D layers, which peft adapts too
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, linear) and module is not head})


def _check_lora_targets(model: torch.nn.Module, targets: list[str] | str) -> None:
    """Every name of a list must match modules of the model (as peft matches: the name, or its last parts); peft
    itself refuses only a list that matches nothing, and adapts the rest silently."""
    if isinstance(targets, str):  # all-linear (a run's one name is a list of it by now)
        return
    names = [name for name, _ in model.named_modules()]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = [name for name, module in model.named_modules() if head is not None and module is head]
    if adapted := [t for t in targets if any(name == t or name.endswith(f".{t}") for name in heads)]:
        raise RecipeError(
            f"lora.target_modules: {adapted[0]!r} is {type(model).__name__}'s output head ({heads[0]}), whose log-probs are computed "
            "in chunks from its plain weight: leave it out (all-linear does)", "lora.target_modules",
        )
    missing = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names)]
    if missing:
        leaves = _linear_leaves(model)
        # Experts kept as one 3-D parameter per projection: peft would adapt those parameters, not modules, which the
        # weight syncs, exports and shardings here do not carry.
        fused = sorted({name for module in model.modules() if not isinstance(module, torch.nn.modules.conv._ConvNd)
                        for name, p in module.named_parameters(recurse=False) if p.dim() == 3})  # fmt: skip
        experts = f"; its experts' projections are fused parameters ({', '.join(fused)}), which LoRA here does not adapt" if fused else ""
        raise RecipeError(
            f"lora.target_modules: {', '.join(map(repr, missing))} {'matches' if len(missing) == 1 else 'match'} no module of {type(model).__name__} "
            f"(its linear layers: {', '.join(leaves)}; or all-linear{experts})", "lora.target_modules",
        )


def outside_text_model(model: torch.nn.Module) -> str | None:
    """A pattern over module (and so parameter) names matching the towers of a multimodal model trained on text.

    Text training never gives them a gradient. So they are frozen in full fine-tuning and get no adapters
    with LoRA (peft's ``exclude_modules``): a trainable weight without a gradient gets no optimizer state,
    which a sharded checkpoint then cannot restore."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    towers: list[str] = []
    node, path = model, []
    for part in next(name for name, module in model.named_modules() if module is decoder).split("."):
        if not part:
            break
        towers += [".".join([*path, name]) for name, child in node.named_children() if name != part and child is not head]
        node, path = getattr(node, part), [*path, part]
    return rf"^({'|'.join(map(re.escape, towers))})\..*" if towers else None


def causal_attention(model_class: type, config: PreTrainedConfig) -> str:
    """``sdpa``, or ``eager`` for a model class transformers runs without it (Gemma-2: its attention soft-caps)."""
    try:
        model_class = model_class._model_mapping[type(config)] if hasattr(model_class, "_model_mapping") else model_class
    except KeyError:
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def end_of_turn_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a reply: the model's generation config's (a chat model's end of turn, as Gemma's
    ``<end_of_turn>``, besides its end of text), the tokenizer's end of sequence, and the special token its chat
    template closes a reply with (a base model's tokenizer ends text with ``<|endoftext|>`` while its ChatML template
    ends turns with ``<|im_end|>``: a model trained on that template ends its replies with ``<|im_end|>``)."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in [*ids, tokenizer.eos_token_id, template_end_of_turn(tokenizer)] if i is not None))


_PROBE_REPLY = "Probe reply 7"


def template_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the tokenizer's chat template writes right after an assistant reply's content (only
    whitespace between); None for a template that closes a reply otherwise, or has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "Probe question"}, {"role": "assistant", "content": _PROBE_REPLY}]
    text = None
    for messages in (conversation, [{"role": "system", "content": "Probe system"}, *conversation]):  # one may need a system
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            break
        except Exception:  # a template that raises on this conversation (jinja's raise_exception): try the next
            continue
    if not isinstance(text, str) or _PROBE_REPLY not in text:
        return None
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} | set(tokenizer.all_special_ids)
    for token in tokenizer(text[text.rindex(_PROBE_REPLY) + len(_PROBE_REPLY) :], add_special_tokens=False)["input_ids"]:
        if token in special:
            return token
        if tokenizer.decode([token]).strip():
            return None
    return None


def saved_generation_config(path: str | Path) -> GenerationConfig | None:
    """The generation config a model folder holds, if it holds one (nothing is downloaded)."""
    return GenerationConfig.from_pretrained(path) if (Path(path) / "generation_config.json").is_file() else None


@contextlib.contextmanager
def generation_config_set_aside(model: torch.nn.Module) -> Iterator[None]:
    """``generate`` fills every setting a call leaves unset from the model's generation config: a checkpoint's
    (repetition_penalty, min_new_tokens, no_repeat_ngram_size, use_cache: false, ...) would change what is sampled or
    scored. Meanwhile the model's own config is set aside: the call's settings alone apply."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    own, model.generation_config = model.generation_config, GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


@torch.no_grad()
def generate_greedy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int = 64,
    images: list[list[dict[str, torch.Tensor]]] | None = None,
) -> list[str]:
    """Greedy completions of token-id prompts, decoded without special tokens; ``images[i]``: the processor inputs
    of prompt ``i``'s images, in order."""
    was_training = model.training
    model.eval()
    # Packed training switches attention to the tree kernel; generation runs ordinary causal attention.
    model.set_attn_implementation(causal_attention(type(model), model.config))
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ends = end_of_turn_ids(getattr(model, "generation_config", None), tokenizer)
    texts: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            pictures = [image for own in (images or [])[start : start + batch_size] for image in own]
            pixels = {key: value.to(device) for key, value in stack_images(pictures).items()}
            if pictures:  # a model whose image tokens attend both ways gets the token types its processor gives
                pixels.update(image_token_types(model, input_ids))
            with generation_config_set_aside(model):  # greedy as the recipe asks, not as the checkpoint's config samples
                out = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, **pixels,
                    generation_config=GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=ends),
                )
            texts.extend(tokenizer.batch_decode(out[:, width:], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return texts


def _readable_as_umask_allows(folder: Path) -> None:
    """Give every file of ``folder`` the mode a plain write would (transformers writes the weights through a private
    temporary file, mode 0600, so others on a shared machine could read every file of the export but the weights)."""
    umask = os.umask(0)
    os.umask(umask)
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~umask)


def _merged_rounded_once(model: PeftModel) -> torch.nn.Module:
    """peft's ``merge_and_unload``, each 16-bit weight rounded once: its layer merged in float32, then cast back (peft
    rounds a 16-bit adapter's product to the weight's dtype, then the sum again). In place, one layer at a time (a
    layer's float32 copy is all the memory it takes), as peft merges."""
    import warnings

    from peft.tuners.lora import LoraLayer

    allowed = getattr(model.base_model, "_check_merge_allowed", None)  # peft's refusals (GPTQ, ...) before any weight moves
    if allowed is not None:
        allowed()
    for layer in model.modules():
        if isinstance(layer, LoraLayer) and not layer.merged:
            dtype = getattr(layer.get_base_layer(), "weight", torch.empty(0)).dtype
            if dtype in (torch.bfloat16, torch.float16):
                layer.float()
                layer.merge()
                layer.to(dtype)
    with warnings.catch_warnings():  # the layers merged above are said to be, one line each
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        return model.merge_and_unload()  # what is left (the layers of other dtypes), then the LoRA modules taken out


def export_hf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    *,
    mode: Literal["model", "merged", "adapter"],
    write: bool = True,
    base_model: str | None = None,
    model_card: str | None = None,
) -> Path:
    """Write a from_pretrained folder at ``path``: built beside it, then swapped in whole.

    A LoRA model is merged into its base (in place, so call this last) unless ``mode`` is ``adapter``; an adapter
    names ``base_model`` as its base (by default peft's, the folder the base was loaded from here). ``model_card`` is
    written as the folder's README.md. A sharded (FSDP2) model is gathered one tensor at a time: every rank must
    call this, and only the one with ``write`` writes.
    """
    if mode == "adapter" and not isinstance(model, PeftModel):
        raise ValueError("export 'adapter' needs a LoRA model")
    state_dict = None
    if any(isinstance(p, DTensor) for p in model.parameters()):
        stream = iter_adapter_weights(model) if mode == "adapter" else iter_full_weights(model, merge_lora=True)
        if write:
            state_dict = {name: tensor.cpu() for name, tensor in stream}
        else:
            for _ in stream:  # every rank joins every gather
                pass
        if mode != "adapter" and isinstance(model, PeftModel):
            model = model.get_base_model()
    elif mode != "adapter" and isinstance(model, PeftModel):
        model = _merged_rounded_once(model)
    path = Path(path)
    if not write:
        return path
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        if mode == "adapter" and base_model is not None:
            # After saving: peft reads the base's config from this name as it saves (to see whether the vocabulary grew).
            # A folder under ~ is written as the shell reads it: from_pretrained does not expand ~.
            adapter_config = staging / "adapter_config.json"
            config = json.loads(adapter_config.read_text(encoding="utf-8"))
            named = os.path.expanduser(base_model) if base_model.startswith("~") else base_model
            adapter_config.write_text(json.dumps({**config, "base_model_name_or_path": named}, indent=2) + "\n", encoding="utf-8")
        if model_card is not None:
            (staging / "README.md").write_text(model_card, encoding="utf-8")  # in place of peft's template
        _readable_as_umask_allows(staging)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)  # an earlier export at ``path`` stays as it was
        written = state_dict if state_dict is not None else get_peft_model_state_dict(model) if mode == "adapter" else model.state_dict()
        full = no_room(error, path.parent, tensor_bytes(written))
        if full is None:
            raise
        kept = f"the partial folder {staging.name} was removed, " + (f"the earlier {path.name}/ is kept" if path.exists() else "no earlier export")
        raise space_error(path, tensor_bytes(written), full, what="the Hugging Face export", kept=kept) from None
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        staging.rename(path)
        shutil.rmtree(old)
    else:
        staging.rename(path)
    return path
