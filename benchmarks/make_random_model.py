"""A model folder with random weights that transformers can load too (unlike
``make_model_dir.py``'s, which holds no weights), for CPU benchmarks against Hugging Face of
shapes no installed model has (e.g. a small mixture of experts).

    python benchmarks/make_random_model.py DEST --shape benchmarks/configs/qwen3-moe-cpu
    baton bench throughput DEST --num-prompts 32 --input-len 128 --output-len 64

DEST gets the default model's tokenizer and chat template, ``--shape``'s config (its
vocabulary must be the tokenizer's, 49,152) and safetensors weights drawn by transformers'
own initialization, scaled up so that the logits are not flat.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from baton_engine.model_files import resolve_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dest", type=Path)
    p.add_argument("--shape", type=Path, required=True, help="folder or file with a config.json")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    shape = args.shape / "config.json" if args.shape.is_dir() else args.shape
    args.dest.mkdir(parents=True, exist_ok=True)
    (args.dest / "config.json").write_text(shape.read_text())
    config = AutoConfig.from_pretrained(args.dest)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, json.loads(shape.read_text()).get("torch_dtype", "float32"))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.05)
    model.save_pretrained(args.dest)
    source = resolve_model(None)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, args.dest / name)
    print(f"{args.dest}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
