"""The example third-party plugin (examples/radixserve-example-plugin), installed in the venv,
adds ExampleLlamaForCausalLM through its entry point, and its logit_scale changes the output."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tiny_models import make_tiny_llama_dir

from radixserve.core.config import ConfigError
from radixserve.core.plugins import default_host
from radixserve.entrypoints import cli

ARCH = "ExampleLlamaForCausalLM"
PROMPT = "Hello world! How are"
NEW_TOKENS = 5
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def example_plugin() -> ModuleType:
    try:
        return importlib.import_module("radixserve_example_plugin")
    except ModuleNotFoundError:
        pytest.fail(
            "radixserve_example_plugin is not installed; run `make setup` or "
            "`pip install -e examples/radixserve-example-plugin`"
        )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One set of random weights under several configs: {variant: model dir}."""
    root = tmp_path_factory.mktemp("example-arch")
    base = make_tiny_llama_dir(root / "scale-default", architecture=ARCH)
    dirs = {"scale-default": base}
    variants: dict[str, dict[str, Any]] = {
        "builtin-llama": {"architectures": ["LlamaForCausalLM"]},
        "scale-0": {"logit_scale": 0.0},
        "scale-2": {"logit_scale": 2.0},
    }
    for name, changes in variants.items():
        dirs[name] = shutil.copytree(base, root / name)
        config = json.loads((base / "config.json").read_text())
        (dirs[name] / "config.json").write_text(json.dumps({**config, **changes}))
    return dirs


def generate(model_dir: Path) -> tuple[list[int], list[float], str]:
    """Greedy output ids and their logprobs, and the name of the model class that served them."""
    from radixserve.entrypoints.engine import Engine

    with Engine(str(model_dir), max_total_tokens=512, host=default_host()) as engine:
        model_class = type(engine.core.runner.model)
        out = engine.generate(PROMPT, GREEDY, return_logprob=True)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    return (
        out["output_ids"],
        [t[0] for t in triples],
        f"{model_class.__module__}.{model_class.__name__}",
    )


def test_package_is_installed_with_its_entry_point(example_plugin: ModuleType) -> None:
    eps = importlib.metadata.entry_points(group="radixserve")
    assert {ep.name: ep.value for ep in eps}.get("example_arch") == "radixserve_example_plugin"
    assert example_plugin.ARCHITECTURE == ARCH


def test_registered_through_the_entry_point(example_plugin: ModuleType) -> None:
    registration = default_host().registries["model"].get(ARCH)
    assert registration.plugin == "example_arch"
    assert registration.factory is example_plugin.build_model


def test_radixserve_plugins_lists_the_architecture(
    example_plugin: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plugins"]) == 0
    rows = [line.split(maxsplit=4) for line in capsys.readouterr().out.splitlines()]
    assert ["model", ARCH, "available", "example_arch"] in [row[:4] for row in rows]


def test_default_scale_serves_exactly_like_the_builtin_llama(
    example_plugin: ModuleType, model_dirs: dict[str, Path]
) -> None:
    ids, logprobs, served_by = generate(model_dirs["scale-default"])
    assert served_by == "radixserve_example_plugin.model.ExampleLlamaForCausalLM"
    assert len(ids) == NEW_TOKENS
    llama_ids, llama_logprobs, llama_class = generate(model_dirs["builtin-llama"])
    assert llama_class == "radixserve.plugins.models.llama.LlamaForCausalLM"
    assert ids == llama_ids
    assert logprobs == pytest.approx(llama_logprobs, abs=1e-5)


def test_logit_scale_zero_makes_every_token_equally_likely(
    example_plugin: ModuleType, model_dirs: dict[str, Path]
) -> None:
    ids, logprobs, _ = generate(model_dirs["scale-0"])
    vocab = json.loads((model_dirs["scale-0"] / "config.json").read_text())["vocab_size"]
    assert len(ids) == NEW_TOKENS
    assert logprobs == pytest.approx([-math.log(vocab)] * NEW_TOKENS, abs=1e-5)


def test_logit_scale_two_sharpens_without_changing_greedy_choices(
    example_plugin: ModuleType, model_dirs: dict[str, Path]
) -> None:
    ids, logprobs, _ = generate(model_dirs["scale-default"])
    sharp_ids, sharp_logprobs, _ = generate(model_dirs["scale-2"])
    assert sharp_ids == ids  # scaling by a positive number keeps every argmax
    # The argmax token's probability grows when the distribution sharpens.
    assert all(s >= p - 1e-6 for s, p in zip(sharp_logprobs, logprobs, strict=True))
    assert sum(sharp_logprobs) > sum(logprobs) + 1e-3


@pytest.mark.parametrize("value", [-1.0, float("inf"), "2", True])
def test_bad_logit_scale_is_a_config_error(example_plugin: ModuleType, value: Any) -> None:
    from radixserve_example_plugin.model import read_logit_scale

    with pytest.raises(ConfigError, match="logit_scale must be"):
        read_logit_scale({"logit_scale": value})
    assert read_logit_scale({}) == 1.0
