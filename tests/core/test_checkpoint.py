"""core/checkpoint.py: a weight reload's checkpoint is checked from config.json and the weight
files' headers alone, before anything pauses (and without torch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_llama_dir

from radixserve.core.checkpoint import check_checkpoint, safetensors_files
from radixserve.core.config import ConfigError, ModelConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("ckpt") / "a")


def _copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "copy"))


def test_a_checkpoint_of_the_running_shape_passes(model: Path) -> None:
    check_checkpoint(model, ModelConfig.from_dir(model))


@pytest.mark.parametrize(
    ("break_it", "needle"),
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"notjson!"),
         "no readable safetensors header"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 8), "bad header length"),
        (lambda d: _truncate(d / "model.safetensors"), "truncated"),
        (lambda d: _config(d, hidden_size=96), "hidden_size"),
        (lambda d: _config(d, rope_theta=123.0), "rope_theta"),
        (lambda d: _resave(d, "model.norm.weight"), "model.norm.weight has shape"),
        (lambda d: _resave(d, "model.embed_tokens.weight"), "embed_tokens.weight has shape"),
        # were 500s (AttributeError, TypeError, RecursionError) on /update_weights_from_disk
        (lambda d: _index(d, ["model.safetensors"]), "not a safetensors index"),
        (lambda d: _header(d, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "x"]}}),
         "no valid data_offsets"),
        (lambda d: _raw_header(d, b"[" * 100_000), "no readable safetensors header"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "config"),
    ],
)  # fmt: skip
def test_a_bad_checkpoint_is_one_config_error(
    model: Path, tmp_path: Path, break_it: object, needle: str
) -> None:
    copy = _copy(model, tmp_path)
    break_it(copy)  # type: ignore[operator]
    with pytest.raises(ConfigError) as e:
        check_checkpoint(copy, ModelConfig.from_dir(model))
    assert needle in str(e.value), str(e.value)


def test_a_path_that_is_no_directory(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model directory"):
        check_checkpoint(tmp_path / "missing", ModelConfig.from_dir(model))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 16])


def _config(model: Path, **changes: object) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


def _resave(model: Path, name: str) -> None:
    tensors = load_file(str(model / "model.safetensors"))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


def _index(model: Path, weight_map: object) -> None:
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _header(model: Path, header: dict[str, object]) -> None:
    _raw_header(model, json.dumps(header).encode())


def _raw_header(model: Path, header: bytes) -> None:
    data = len(header).to_bytes(8, "little") + header + b"\0" * 8
    (model / "model.safetensors").write_bytes(data)


def test_weight_files_as_transformers_picks_them(tmp_path: Path) -> None:
    (tmp_path / "b.safetensors").write_bytes(b"")
    (tmp_path / "a.safetensors").write_bytes(b"")
    assert safetensors_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert safetensors_files(tmp_path) == [tmp_path / "model.safetensors"]
    _index(tmp_path, {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert safetensors_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    index = tmp_path / "model.safetensors.index.json"
    _index(tmp_path, {"x": "c.safetensors", "y": "a.safetensors", "z": "d.safetensors"})
    with pytest.raises(ConfigError) as e:
        safetensors_files(tmp_path)
    assert (
        str(e.value)
        == f"'{index}' lists weight files that are missing: c.safetensors, d.safetensors"
    )
    _index(tmp_path, {"x": 3})
    with pytest.raises(ConfigError) as e:
        safetensors_files(tmp_path)
    assert str(e.value) == f"'{index}' is not a safetensors index (weight_map: name -> file)"
    index.write_text('{"metadata": {}}')
    with pytest.raises(ConfigError) as e:
        safetensors_files(tmp_path)
    assert str(e.value) == f"'{index}' is not a safetensors index (no weight_map): 'weight_map'"


def _h(header: dict[str, object]) -> bytes:
    """A safetensors file of ``header`` and 8 bytes of data."""
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + b"\0" * 8


def test_reload_config_messages_and_free_fields(model: Path, tmp_path: Path) -> None:
    running = ModelConfig.from_dir(model)
    copy = _copy(model, tmp_path)
    _config(copy, hidden_size=96)
    with pytest.raises(ConfigError) as e:
        check_checkpoint(copy, running)
    assert str(e.value) == (
        f"'{copy}' has hidden_size=96; the running model has 64 (only weights of the same "
        "shape can be loaded)"
    )
    _config(copy, hidden_size=64, rms_norm_eps=1e-06)
    with pytest.raises(ConfigError) as e:
        check_checkpoint(copy, running)
    assert str(e.value) == (
        f"'{copy}' has rms_norm_eps=1e-06; the running model was built with 1e-05 (restart "
        "the server to load this model)"
    )
    _config(copy, rms_norm_eps=1e-05, torch_dtype="float16", _name_or_path="elsewhere", _extra=1)
    check_checkpoint(copy, running)  # free fields and "_" keys may change


def _weights(model: Path, data: bytes) -> None:
    (model / "model.safetensors").write_bytes(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # the smallest header, filling the file exactly: no tensors, a valid file
        (b"\x02" + b"\0" * 7 + b"{}", None),
        (b"\x03" + b"\0" * 7 + b"{}", " is not a safetensors file (bad header length)"),
        (b"\x01" + b"\0" * 7 + b"{}", " is not a safetensors file (bad header length)"),
        (b"\x03" + b"\0" * 7 + b"[1]", " has no readable safetensors header"),
        (_h({"w": {"data_offsets": [0, 0], "shape": [0]}}), None),  # an empty tensor
        (_h({"w": {"data_offsets": [2, 1]}}), ": tensor 'w' has no valid data_offsets"),
        (_h({"w": 5}), ": tensor 'w' has no valid data_offsets"),
        (_h({"__metadata__": {"format": "pt"}}), None),
    ],
)
def test_safetensors_headers(model: Path, tmp_path: Path, data: bytes, message: str | None) -> None:
    copy = _copy(model, tmp_path)
    _weights(copy, data)
    path = copy / "model.safetensors"
    if message is None:
        check_checkpoint(copy, ModelConfig.from_dir(model))
        return
    with pytest.raises(ConfigError) as e:
        check_checkpoint(copy, ModelConfig.from_dir(model))
    assert str(e.value) == f"'{path}'{message}"


def test_an_unreadable_weight_file_is_named(model: Path, tmp_path: Path) -> None:
    copy = _copy(model, tmp_path)
    (copy / "model.safetensors").unlink()
    (copy / "x.safetensors").mkdir()  # a directory where a weight file should be
    with pytest.raises(ConfigError) as e:
        check_checkpoint(copy, ModelConfig.from_dir(model))
    assert str(e.value) == f"cannot read '{copy / 'x.safetensors'}': Is a directory"
