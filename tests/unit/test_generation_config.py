"""A model's generation config as requests' default sampling params (vLLM's
``--generation-config`` and ``--override-generation-config``): which keys are read, where from,
and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton_engine.errors import InvalidRequestError, ModelLoadError
from baton_engine.model_files import generation_defaults


def model_dir(root: Path, generation_config: dict[str, object] | None) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_the_model_folders_generation_config(tmp_path: Path) -> None:
    config = {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_new_tokens": 300,
        "bos_token_id": 1,
        "min_p": None,
    }
    folder = str(model_dir(tmp_path, config))
    expected = {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 300,
    }
    assert generation_defaults(folder) == expected
    assert generation_defaults(folder, "vllm") == {}
    overridden = generation_defaults(folder, overrides={"temperature": 0.0, "max_new_tokens": 9})
    assert overridden == {**expected, "temperature": 0.0, "max_tokens": 9}
    assert generation_defaults(folder, "vllm", {"top_k": 5}) == {"top_k": 5}


def test_a_generation_config_from_another_folder(tmp_path: Path) -> None:
    folder = str(model_dir(tmp_path, None))
    assert generation_defaults(folder) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert generation_defaults(folder, str(other)) == {"temperature": 0.3}


def test_errors_name_what_is_wrong(tmp_path: Path) -> None:
    folder = str(model_dir(tmp_path, None))
    with pytest.raises(ModelLoadError, match="no such folder"):
        generation_defaults(folder, str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="unknown keys seed; the keys are"):
        generation_defaults(folder, overrides={"seed": 1})
    (Path(folder) / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        generation_defaults(folder)
