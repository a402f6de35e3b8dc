"""Shared fixtures: the default model (converted once per machine into ~/.cache/baton) and
Hugging Face reference objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from baton_engine.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from baton_engine.model_loader import load_tokenizer

    return load_tokenizer(default_model_dir)
