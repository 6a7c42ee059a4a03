"""The embedded toy world that `make run` trains without a model hub: a verifiable digit task (``task``) and a tiny
Qwen3-style model with a byte-level BPE tokenizer trained on it (``model``), saved and loaded through
``from_pretrained``."""
