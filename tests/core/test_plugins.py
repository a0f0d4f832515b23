"""PluginHost: entry-point loading, registries, availability, selection and hardware choice."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

import radixserve
from radixserve.core import plugins as plugins_module
from radixserve.core.interfaces import PLUGIN_KINDS
from radixserve.core.plugins import PluginError, PluginHost, parse_plugin_selections

# The built-in implementations per kind, and the entry point (plugin) that registers each.
BUILTINS = {
    "hardware": {"cpu": "cpu"},
    "attention": {"torch_native": "torch_native"},
    "model": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"},
    "grammar": {
        "none": "grammar_none",
        "xgrammar": "grammar_xgrammar",
        "outlines": "grammar_outlines",
        "llguidance": "grammar_llguidance",
    },
    "speculative": {"none": "speculative_none"},
    "kv_transfer": {
        "none": "kv_transfer_none",
        "tcp": "kv_transfer_tcp",
        "mooncake": "kv_transfer_mooncake",
        "nixl": "kv_transfer_nixl",
    },
}


def fake_plugin(**hooks: Any) -> SimpleNamespace:
    """A plugin object whose attributes are the given functions, marked as hook implementations."""
    return SimpleNamespace(**{name: radixserve.hookimpl(fn) for name, fn in hooks.items()})


def attention_plugin(*names: str, available: Any = None) -> SimpleNamespace:
    def register_attention_backends(register: Any) -> None:
        for name in names:
            register(name, FakeBackend, available=available, description=f"fake {name}")

    return fake_plugin(register_attention_backends=register_attention_backends)


def hardware_plugin(*platforms: tuple[str, int, str | None]) -> SimpleNamespace:
    """Registers (name, priority, unavailable reason or None) platforms."""

    def register_hardware_platforms(register: Any) -> None:
        for name, priority, reason in platforms:
            register(name, FakeBackend, available=lambda r=reason: r, priority=priority)

    return fake_plugin(register_hardware_platforms=register_hardware_platforms)


class FakeBackend:
    def __init__(self, *args: Any) -> None:
        self.args = args


def test_entry_points_fill_all_six_kinds_with_the_builtins() -> None:
    host = PluginHost()
    assert set(host.registries) == set(PLUGIN_KINDS)
    for kind, expected in BUILTINS.items():
        registry = host.registries[kind]
        found = {r.name: r.plugin for r in registry.entries()}
        assert expected.items() <= found.items(), kind
        # the transfer plugins report themselves unavailable where their library is not
        # installed (the dev extra installs both; a GPU machine's image may not)
        missing = {n for n in ("mooncake", "nixl") if importlib.util.find_spec(n) is None}
        needed = set(expected) - (missing if kind == "kv_transfer" else set())
        assert needed <= set(registry.available_names()), kind


def test_fake_plugin_adds_an_attention_backend_without_entry_points() -> None:
    host = PluginHost(load_entry_points=False, extra_plugins=[("fake", attention_plugin("fast"))])
    registration = host.select("attention", "fast", None)
    assert registration.plugin == "fake"
    assert registration.description == "fake fast"
    assert registration.factory is FakeBackend
    assert host.registries["attention"].names() == ["fast"]  # no built-ins were loaded
    assert host.registries["hardware"].names() == []


def test_duplicate_names_raise_naming_both_plugins() -> None:
    with pytest.raises(PluginError) as info:
        PluginHost(
            load_entry_points=False,
            extra_plugins=[("first", attention_plugin("x")), ("second", attention_plugin("x"))],
        )
    message = str(info.value)
    assert "attention 'x' registered twice" in message
    assert "'first'" in message and "'second'" in message


def test_third_party_name_clashing_with_a_builtin_is_an_error() -> None:
    with pytest.raises(PluginError, match="'torch_native'.*'intruder'"):
        PluginHost(extra_plugins=[("intruder", attention_plugin("torch_native"))])


def test_unknown_name_is_one_line_naming_the_choices_and_the_listing_command() -> None:
    host = PluginHost(load_entry_points=False, extra_plugins=[("fake", attention_plugin("a", "b"))])
    with pytest.raises(PluginError) as info:
        host.select("attention", "nope", None)
    message = str(info.value)
    assert "\n" not in message
    assert "unknown attention plugin 'nope'" in message
    assert "available: a, b" in message
    assert "radixserve plugins" in message


def test_unavailable_implementation_is_listed_but_selecting_it_gives_the_reason() -> None:
    host = PluginHost(
        load_entry_points=False,
        extra_plugins=[
            ("gpu", attention_plugin("flash", available=lambda: "needs a CUDA device")),
            ("ref", attention_plugin("ref")),
        ],
    )
    registry = host.registries["attention"]
    assert registry.names() == ["flash", "ref"]
    assert registry.available_names() == ["ref"]
    assert registry.entries()[0].unavailable_reason() == "needs a CUDA device"
    with pytest.raises(PluginError) as info:
        host.select("attention", "flash", None)
    message = str(info.value)
    assert "attention plugin 'flash' is unavailable (needs a CUDA device)" in message
    assert "available: ref" in message
    # A hardware default that is unavailable fails the same way.
    with pytest.raises(PluginError, match="needs a CUDA device"):
        host.select("attention", None, "flash")


def test_select_without_request_or_default_asks_for_a_plugin_flag() -> None:
    host = PluginHost(load_entry_points=False, extra_plugins=[("ref", attention_plugin("ref"))])
    with pytest.raises(PluginError, match="pass --plugin attention=NAME .*available: ref"):
        host.select("attention", None, None)


def test_parse_plugin_selections() -> None:
    assert parse_plugin_selections(None) == {}
    assert parse_plugin_selections(["attention=triton", " grammar = xgrammar "]) == {
        "attention": "triton",
        "grammar": "xgrammar",
    }
    assert parse_plugin_selections({"speculative": "ngram"}) == {"speculative": "ngram"}
    with pytest.raises(PluginError, match="--plugin expects KIND=NAME, got 'attention'"):
        parse_plugin_selections(["attention"])
    with pytest.raises(PluginError, match="got 'attention='"):
        parse_plugin_selections(["attention="])
    with pytest.raises(PluginError) as info:
        parse_plugin_selections(["flux=capacitor"])
    assert "unknown plugin kind 'flux'" in str(info.value)
    assert ", ".join(PLUGIN_KINDS) in str(info.value)
    with pytest.raises(PluginError, match="unknown plugin kind 'flux'"):
        parse_plugin_selections({"flux": "capacitor"})
    # two plugins of one kind: refused (the later one used to win silently); the same twice
    # is one selection
    with pytest.raises(PluginError, match="two grammar plugins, 'xgrammar' and 'outlines'"):
        parse_plugin_selections(["grammar=xgrammar", "grammar=outlines"])
    assert parse_plugin_selections(["grammar=xgrammar"] * 2) == {"grammar": "xgrammar"}
    # one selection as a string is that selection, not its characters
    assert parse_plugin_selections("attention=torch_native") == {"attention": "torch_native"}


def test_allow_restricts_which_entry_points_load() -> None:
    host = PluginHost(allow=["cpu"])
    assert host.registries["hardware"].names() == ["cpu"]
    assert host.pm.has_plugin("cpu")
    for kind in ("attention", "model", "grammar", "speculative", "kv_transfer"):
        assert host.registries[kind].names() == [], kind
    assert not host.pm.has_plugin("torch_native")


def test_entry_point_that_fails_to_import_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = importlib.metadata.EntryPoint(
        name="broken", value="radixserve_no_such_module_for_tests", group="radixserve"
    )
    monkeypatch.setattr(plugins_module.importlib.metadata, "entry_points", lambda group: [broken])
    with pytest.raises(PluginError) as info:
        PluginHost()
    message = str(info.value)
    assert message.startswith(
        "plugin 'broken' (radixserve_no_such_module_for_tests) failed to import:"
    )
    assert "No module named 'radixserve_no_such_module_for_tests'" in message


def test_hook_with_a_wrong_argument_name_is_rejected_naming_the_plugin() -> None:
    def register_models(registrar: Any) -> None:  # the spec's argument is `register`
        raise AssertionError("must not be called")

    with pytest.raises(PluginError, match="plugin 'typo' is invalid"):
        PluginHost(
            load_entry_points=False,
            extra_plugins=[("typo", fake_plugin(register_models=register_models))],
        )


def test_select_hardware_picks_the_highest_priority_available_platform() -> None:
    platforms = hardware_plugin(("cpu", 0, None), ("gpu", 10, None), ("npu", 99, "no NPU found"))
    host = PluginHost(load_entry_points=False, extra_plugins=[("hw", platforms)])
    assert host.select_hardware().name == "gpu"
    assert host.select_hardware("cpu").name == "cpu"  # an explicit request wins
    with pytest.raises(PluginError, match=r"'npu' is unavailable \(no NPU found\)"):
        host.select_hardware("npu")


def test_select_hardware_platform_hook_overrides_priority() -> None:
    seen: list[list[str]] = []

    def select_hardware_platform(available: list[str]) -> str | None:
        seen.append(list(available))
        return "cpu"

    platforms = hardware_plugin(("cpu", 0, None), ("gpu", 10, None), ("npu", 99, "no NPU found"))
    chooser = fake_plugin(select_hardware_platform=select_hardware_platform)
    host = PluginHost(load_entry_points=False, extra_plugins=[("hw", platforms), ("pick", chooser)])
    assert host.select_hardware().name == "cpu"
    assert seen == [["cpu", "gpu"]]  # only the available platforms are offered


def test_select_hardware_platform_answer_none_falls_back_to_priority() -> None:
    platforms = hardware_plugin(("cpu", 0, None), ("gpu", 10, None))
    abstain = fake_plugin(select_hardware_platform=lambda available: None)
    host = PluginHost(load_entry_points=False, extra_plugins=[("hw", platforms), ("no", abstain)])
    assert host.select_hardware().name == "gpu"


def test_no_available_hardware_is_an_error() -> None:
    platforms = hardware_plugin(("npu", 5, "no NPU found"))
    host = PluginHost(load_entry_points=False, extra_plugins=[("hw", platforms)])
    with pytest.raises(PluginError, match="no hardware platform is available"):
        host.select_hardware()


def test_registration_mistakes_and_plain_defaults_are_named_exactly() -> None:
    def registering(**kw: Any) -> SimpleNamespace:
        def register_attention_backends(register: Any) -> None:
            register(kw.pop("name", "x"), kw.pop("factory", FakeBackend), **kw)

        return fake_plugin(register_attention_backends=register_attention_backends)

    host = PluginHost(load_entry_points=False, extra_plugins=[("plain", registering())])
    plain = host.registries["attention"].get("x")
    assert (plain.kind, plain.description, plain.priority, plain.available) == (
        "attention", "", 0, None)  # fmt: skip
    cases = [
        ({"name": ""}, "plugin 'bad' registered a attention with no name"),
        ({"name": 7}, "plugin 'bad' registered a attention with no name"),
        ({"factory": 3}, "plugin 'bad': attention 'x' factory not callable"),
        ({"colour": 1}, "plugin 'bad' failed in register_attention_backends: "),
    ]
    for kw, message in cases:
        with pytest.raises(PluginError) as info:
            PluginHost(load_entry_points=False, extra_plugins=[("bad", registering(**kw))])
        assert str(info.value).startswith(message), kw
    with pytest.raises(PluginError) as info:
        twice = [("p", registering()), ("p", registering(name="y"))]
        PluginHost(load_entry_points=False, extra_plugins=twice)
    assert str(info.value) == "plugin name 'p' is used twice; rename one"
    empty = PluginHost(load_entry_points=False)
    with pytest.raises(PluginError) as info:
        empty.registries["attention"].get("x")
    assert str(info.value) == (
        "unknown attention plugin 'x'; available: none; see `radixserve plugins`"
    )
    with pytest.raises(PluginError) as info:
        empty.select_hardware()
    assert str(info.value) == "no hardware platform is available; see `radixserve plugins`"
    two = PluginHost(load_entry_points=False,
                     extra_plugins=[("f", attention_plugin("a", "b"))])  # fmt: skip
    with pytest.raises(PluginError) as info:
        two.select("attention", None, None)
    assert str(info.value).endswith("(available: a, b)")
    # a name holding "=" keeps it: only the first one separates the kind
    assert parse_plugin_selections(["model=a=b"]) == {"model": "a=b"}
    with pytest.raises(PluginError, match="got '=triton'"):
        parse_plugin_selections(["=triton"])


def test_a_pending_hook_of_an_unknown_name_names_its_plugin() -> None:
    plugin = fake_plugin(register_things=lambda register: None)
    with pytest.raises(PluginError) as info:
        PluginHost(load_entry_points=False, extra_plugins=[("oddity", plugin)])
    assert str(info.value).startswith("plugin 'oddity' is invalid: ")


def test_the_builtin_plugins_are_radixserves_own_entry_points() -> None:
    names = plugins_module.builtin_plugin_names()
    assert {"cpu", "torch_native", "llama", "grammar_none", "speculative_none"} <= names
    eps = importlib.metadata.entry_points(group=plugins_module.ENTRY_POINT_GROUP)
    assert names == {ep.name for ep in eps if ep.value.startswith("radixserve.")}
