"""ModelConfig (core/model_config.py): what the core reads of a checkpoint's config.json, its
defaults and its refusals (exact messages), engine-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve.core.config_checks import ConfigError
from radixserve.core.model_config import ModelConfig

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM", "Other"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 3,
    "vocab_size": 100,
}


def test_every_field_read_and_the_defaults() -> None:
    mc = ModelConfig.from_dict(dict(BASE))
    assert mc == ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,  # as many as the query heads
        head_dim=16,  # hidden // heads
        vocab_size=100,
        max_context=2048,
        eos_token_ids=(),
        bos_token_id=None,
        raw=BASE,
    )


def test_explicit_fields_win_over_the_defaults() -> None:
    raw = {
        **BASE,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "eos_token_id": "7",
        "bos_token_id": 1,
    }
    mc = ModelConfig.from_dict(raw)
    assert (mc.num_kv_heads, mc.head_dim, mc.max_context) == (2, 32, 512)
    assert mc.eos_token_ids == (7,) and mc.bos_token_id == 1
    assert mc.raw is raw


@pytest.mark.parametrize("null", [None, 0])
def test_null_or_zero_optional_fields_take_the_defaults(null: Any) -> None:
    raw = {**BASE, "num_key_value_heads": null, "head_dim": null, "max_position_embeddings": null}
    mc = ModelConfig.from_dict(raw)
    assert (mc.num_kv_heads, mc.head_dim, mc.max_context) == (4, 16, 2048)


def test_a_list_of_eos_ids_stays_a_tuple() -> None:
    assert ModelConfig.from_dict({**BASE, "eos_token_id": [2, 5]}).eos_token_ids == (2, 5)
    assert ModelConfig.from_dict({**BASE, "eos_token_id": 0}).eos_token_ids == (0,)


def test_a_vision_language_config_reads_its_text_config() -> None:
    text = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 50, "eos_token_id": 9}  # fmt: skip
    raw = {"architectures": ["Vlm"], "text_config": text, "eos_token_id": 3}
    mc = ModelConfig.from_dict(raw)
    assert (mc.architecture, mc.hidden_size, mc.num_heads, mc.vocab_size) == ("Vlm", 32, 2, 50)
    assert mc.eos_token_ids == (3,)  # the top level wins
    assert mc.raw == {**text, **raw}
    # a top-level hidden_size means the text_config is not the language model's
    top = {**BASE, "text_config": {**text, "hidden_size": 8, "num_key_value_heads": 1}}
    assert ModelConfig.from_dict(top).hidden_size == 64
    assert ModelConfig.from_dict(top).num_kv_heads == 4  # text_config not read at all
    assert ModelConfig.from_dict({**BASE, "text_config": "no"}).hidden_size == 64


@pytest.mark.parametrize("archs", [None, []])
def test_no_architectures(archs: Any) -> None:
    raw = {**BASE, "architectures": archs}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert str(e.value) == "config.json names no 'architectures'"
    with pytest.raises(ConfigError, match="names no"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "architectures"})


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"]
)
def test_a_missing_required_field_is_named(field: str) -> None:
    raw = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    assert str(e.value) == f"config.json lacks required field '{field}'"
    assert isinstance(e.value.__cause__, KeyError)


def test_from_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dict(dict(BASE))
    assert ModelConfig.from_dir(str(tmp_path)).num_layers == 3


def test_from_dir_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(tmp_path)
    assert str(e.value) == f"model directory '{tmp_path}' has no config.json"
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        ModelConfig.from_dir(tmp_path)  # a directory is no file
    (tmp_path / "config.json").rmdir()
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(tmp_path)
    assert str(e.value).startswith(f"{path} is not a valid JSON file: Expecting")
    assert e.value.__cause__ is None and e.value.__suppress_context__
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="is not a valid JSON file"):
        ModelConfig.from_dir(tmp_path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(tmp_path)
    assert str(e.value) == f"{path} must hold a JSON object, got list"
