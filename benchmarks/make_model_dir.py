"""A model folder for ``--load-format dummy`` runs on hosts without the default model's GGUF.

    python benchmarks/make_model_dir.py DEST [--shape benchmarks/configs/llama-3.1-8b]

DEST gets the default model's tokenizer and chat template (a few MB, converted from its GGUF
here) and a ``config.json``: the default model's own, or ``--shape``'s with the vocabulary and
special-token ids replaced by the tokenizer's (so every sampled id detokenizes). ``baton serve
DEST --load-format dummy`` then serves that shape with random weights: timings of the real
architecture, for GPU hosts where the GGUF cannot travel (benchmarks/device/).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from baton_engine.model_files import resolve_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_TOKEN_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dest", type=Path)
    p.add_argument("--shape", type=Path, default=None, help="folder or file with a config.json")
    args = p.parse_args()

    source = resolve_model(None)
    args.dest.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, args.dest / name)
    config = json.loads((source / "config.json").read_text())
    if args.shape is not None:
        shape_file = args.shape / "config.json" if args.shape.is_dir() else args.shape
        shaped = json.loads(shape_file.read_text())
        shaped.update({k: config[k] for k in _TOKEN_KEYS if k in config})
        config = shaped
    (args.dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"{args.dest}: {config['model_type']}, hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}"
    )


if __name__ == "__main__":
    main()
