"""Write the configs of models too large to download for planning, from their transformers classes.

`lightning-rl plan` reads `lightning_rl/planner/models/<model id>/config.json` (package data) when the model is neither a local
folder nor in the Hugging Face cache. Muse Spark Open's class defaults are the released sizes
(62 layers, hidden 8192, 256 experts top-8, vocabulary 202,048).

    python lightning_rl/planner/models/regenerate.py
"""

from pathlib import Path

from transformers import MuseSparkConfig

CONFIGS = {"meta-models/Muse-Spark-Open-816B-A42B": MuseSparkConfig(architectures=["MuseSparkForConditionalGeneration"])}

if __name__ == "__main__":
    for model_id, config in CONFIGS.items():
        config.save_pretrained(Path(__file__).parent / model_id)
        print(Path(__file__).parent / model_id / "config.json")
