"""Where a recipe's ``model_name_or_path`` points: a from_pretrained folder, a Hugging Face Hub id, or an embedded tiny model."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any
from pathlib import Path

from transformers import AutoConfig

from lightning_rl import validation
from lightning_rl.errors import RecipeError
from lightning_rl.toy.model import TINY_MOE_NAME, TINY_NAME, tiny_model_path, tiny_moe_path
from lightning_rl.toy.vlm import TINY_VLM_NAME, tiny_vlm_path

HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
EMBEDDED = (TINY_NAME, TINY_VLM_NAME, TINY_MOE_NAME)  # the models this package builds itself, by name


def resolve_model_path(name_or_path: str, key: str = "model_name_or_path") -> str:
    """A from_pretrained folder or hub id, as given once ``check_model_source`` found it; ``tiny``, the embedded
    default, is built once and cached."""
    if name_or_path == TINY_NAME:
        return str(tiny_model_path())
    if name_or_path == TINY_VLM_NAME:
        return str(tiny_vlm_path())
    if name_or_path == TINY_MOE_NAME:
        return str(tiny_moe_path())
    check_model_source(name_or_path, key)
    return os.path.expanduser(name_or_path) if name_or_path.startswith("~") else name_or_path  # a folder: checked there


_ROTARY_OR_RELATIVE = ("rope_parameters", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base", "alibi")


def learned_positions(path: str) -> tuple[int, str] | None:
    """``(size, config key)`` of the table of absolute positions a model learned (GPT-2's ``n_positions``), past which
    its forward fails; None for a model whose positions are rotary or relative (they run past their trained length)."""
    config = AutoConfig.from_pretrained(path).get_text_config()
    if any(getattr(config, key, None) for key in _ROTARY_OR_RELATIVE):
        return None
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key), key
    return None


_SCALED_ROPE = ("yarn", "linear", "dynamic")  # rope types whose factor stretches the positions a model reaches


def model_context(config: Any) -> int | None:
    """The longest sequence a model's positions cover: ``max_position_embeddings``, or with a rope scaled by a factor
    (YaRN, linear, dynamic) the original length times it where longer (Qwen's YaRN recipe leaves
    ``max_position_embeddings`` as it was); None where the config gives none."""
    text = config.get_text_config()
    length = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if not isinstance(length, int):
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    for params in [rope, *rope.values()] if isinstance(rope, dict) else []:  # Gemma 3: one set per layer type
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) in _SCALED_ROPE and params.get("factor"):
            length = max(length, int((params.get("original_max_position_embeddings") or length) * params["factor"]))
    return length


def check_model_source(name_or_path: str, key: str = "model_name_or_path", loads: bool = False) -> None:
    """Refuse, naming ``key``, a model that is neither a from_pretrained folder nor a hub id in the local cache or on
    the Hub. The Hub is asked once, without retries, so a wrong id fails in seconds (offline: at once). ``loads``: a
    folder the run will train is checked as it will load, before the run writes anything (`_check_loadable`)."""
    if name_or_path in EMBEDDED:
        return
    path = Path(name_or_path).expanduser()
    if (path.suffix == ".ckpt" and path.exists()) or (path / "meta.pt").is_file() or (path.is_dir() and any(path.glob("*.distcp"))):
        raise RecipeError(f"{key}: {name_or_path} is a training checkpoint, not a model folder: resume the run from it with "
                          "ckpt_path, or start from the model the run wrote (its hf/ folder)", key)
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():  # a run's `export: adapter`
            try:
                base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            except (ValueError, AttributeError):
                base = None
            raise RecipeError(f"{key}: {name_or_path} is a PEFT adapter{f' of {base}' if base else ''}, not a model folder: start "
                              "from a merged export (model.export: merged), or from its base", key)
        if not (path / "config.json").is_file():
            raise RecipeError(f"{key}: {name_or_path} is a folder without config.json, not a model folder", key)
        from transformers import AutoConfig

        try:  # a config transformers cannot read (broken JSON, an unknown model_type) fails here, not deep in a load
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise RecipeError(f"{key}: {name_or_path}/config.json cannot be read by transformers ({' '.join(str(error).split())[:200]})", key) from None
        if loads:
            _check_loadable(path, config, name_or_path, key)
        return
    if path.exists() or not HUB_ID.fullmatch(name_or_path) or name_or_path.startswith("."):
        raise RecipeError(f"{key}: no model folder at {name_or_path}{validation.resolved_against(path)}", key)
    if problem := _hub_problem(name_or_path):
        raise RecipeError(f"{key}: {name_or_path} is neither a local folder nor {problem}", key)


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")


def _check_loadable(path: Path, config: Any, name_or_path: str, key: str) -> None:
    """A model folder holds weights and a tokenizer that loads, whose ids the model's embedding covers: otherwise a run
    ends in a traceback from transformers (a missing file), or deep in its first forward (an id past the embedding)."""
    from transformers import AutoTokenizer

    if not any(next(path.glob(pattern), None) for pattern in _WEIGHTS):
        raise RecipeError(f"{key}: {name_or_path} holds no weights (no *.safetensors or pytorch_model*.bin): not a model folder to train", key)
    if not any(next(path.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        raise RecipeError(f"{key}: {name_or_path} holds no tokenizer (no tokenizer.json, tokenizer_config.json, tokenizer.model, ...)", key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"{key}: {name_or_path} holds a tokenizer that does not load: {' '.join(str(error).split())[:160]}", key) from None
    # A text model's embedding has vocab_size rows; an image-text model's may have more (Mllama's image tokens).
    rows = getattr(config, "vocab_size", None) if config.get_text_config() is config else None
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise RecipeError(f"{key}: {name_or_path}: its tokenizer has {len(tokenizer)} tokens, but the model's embedding {rows} rows "
                          f"(config vocab_size): ids from {rows} on have no embedding", key)


@functools.lru_cache(maxsize=None)
def _hub_problem(repo_id: str) -> str | None:
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "a model in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
    try:
        huggingface_hub.model_info(repo_id, timeout=10)
    except GatedRepoError:
        return None  # it exists; from_pretrained asks for the access it needs
    except RepositoryNotFoundError:
        return "a model on the Hugging Face Hub (none by that id, or it is private and no token gives access)"
    except Exception as error:  # the Hub cannot be reached: no network, a proxy, a timeout
        return f"a model in the local Hugging Face cache, and the Hub cannot be reached ({type(error).__name__}: {error})"
    return None
