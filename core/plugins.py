"""Plugin manager: entry-point loading, one registry per kind, ``--plugin KIND=NAME`` selection.

Built-in and third-party plugins load the same way: modules named in the entry-point group
``radixserve``. Registries hold lazy factories, so listing plugins never imports a vendor
library; availability is asked only when listing or selecting.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import pluggy

from radixserve.core import hookspecs
from radixserve.core.interfaces import PLUGIN_KINDS

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME

# Which registration hook fills which registry.
_REGISTER_HOOKS = {
    "hardware": "register_hardware_platforms",
    "attention": "register_attention_backends",
    "model": "register_models",
    "grammar": "register_grammar_backends",
    "speculative": "register_speculative_algorithms",
    "kv_transfer": "register_kv_connectors",
    "hicache_storage": "register_hicache_storage_backends",
}


class PluginError(Exception):
    """A plugin failed to load or register, or a selection names no usable implementation."""


@dataclass(frozen=True, slots=True)
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    description: str = ""
    available: Callable[[], str | None] | None = None
    priority: int = 0

    def unavailable_reason(self) -> str | None:
        """None when usable, else a one-line reason."""
        if self.available is None:
            return None
        return self.available()


class Registry:
    """Named implementations of one plugin kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Registration] = {}

    def add(self, registration: Registration) -> None:
        existing = self._entries.get(registration.name)
        if existing is not None:
            raise PluginError(
                f"{self.kind} '{registration.name}' registered twice: by plugin "
                f"'{existing.plugin}' and by plugin '{registration.plugin}'"
            )
        self._entries[registration.name] = registration

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Registration]:
        return [self._entries[n] for n in self.names()]

    def available_names(self) -> list[str]:
        return [r.name for r in self.entries() if r.unavailable_reason() is None]

    def get(self, name: str) -> Registration:
        """The usable implementation called ``name``; a one-line PluginError otherwise."""
        registration = self._entries.get(name)
        if registration is None:
            raise PluginError(
                f"unknown {self.kind} plugin '{name}'; available: {self._choices()}; "
                "see `radixserve plugins`"
            )
        reason = registration.unavailable_reason()
        if reason is not None:
            raise PluginError(
                f"{self.kind} plugin '{name}' is unavailable ({reason}); "
                f"available: {self._choices()}"
            )
        return registration

    def _choices(self) -> str:
        return ", ".join(self.available_names()) or "none"


class PluginHost:
    """Loads plugins once and answers which implementation to use for each kind."""

    def __init__(
        self,
        load_entry_points: bool = True,
        extra_plugins: Iterable[tuple[str, object]] = (),
        allow: Iterable[str] | None = None,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registries = {kind: Registry(kind) for kind in PLUGIN_KINDS}
        allowed = None if allow is None else set(allow)
        if load_entry_points:
            for name, module in _load_entry_point_modules(allowed):
                self._add_plugin(name, module)
        for name, plugin in extra_plugins:
            self._add_plugin(name, plugin)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin '{self.pm.get_name(e.plugin)}' is invalid: {e}") from e

    def _add_plugin(self, name: str, plugin: object) -> None:
        if self.pm.has_plugin(name):
            raise PluginError(f"plugin name '{name}' is used twice; rename one")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin '{name}' is invalid: {e}") from e
        for kind, hook_name in _REGISTER_HOOKS.items():
            # Only functions marked @hookimpl count, exactly as pluggy would call them.
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != name:
                    continue
                try:
                    impl.function(register=self._register_callback(kind, name))
                except PluginError:
                    raise
                except Exception as e:  # noqa: BLE001 - re-raised with the plugin's name
                    raise PluginError(f"plugin '{name}' failed in {hook_name}: {e}") from e

    def _register_callback(self, kind: str, plugin_name: str) -> Callable[..., None]:
        registry = self.registries[kind]

        def register(
            name: str,
            factory: Callable[..., Any],
            *,
            available: Callable[[], str | None] | None = None,
            description: str = "",
            priority: int = 0,
        ) -> None:
            if not name or not isinstance(name, str):
                raise PluginError(f"plugin '{plugin_name}' registered a {kind} with no name")
            if not callable(factory):
                raise PluginError(f"plugin '{plugin_name}': {kind} '{name}' factory not callable")
            registry.add(
                Registration(kind, name, factory, plugin_name, description, available, priority)
            )

        return register

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def select_hardware(self, requested: str | None = None) -> Registration:
        registry = self.registries["hardware"]
        if requested:
            return registry.get(requested)
        usable = [r for r in registry.entries() if r.unavailable_reason() is None]
        if not usable:
            raise PluginError("no hardware platform is available; see `radixserve plugins`")
        chosen = self.pm.hook.select_hardware_platform(available=[r.name for r in usable])
        if chosen:
            return registry.get(chosen)
        return max(usable, key=lambda r: r.priority)

    def select(self, kind: str, requested: str | None, default: str | None) -> Registration:
        """The implementation named by the user, else the hardware default."""
        registry = self.registries[kind]
        name = requested or default
        if name is None:
            raise PluginError(
                f"no {kind} plugin chosen and the hardware gives no default; "
                f"pass --plugin {kind}=NAME (available: {', '.join(registry.available_names())})"
            )
        return registry.get(name)


def parse_plugin_selections(values: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Parse ``["attention=triton", ...]`` (or a mapping) into {kind: name}, checking kinds."""
    if values is None:
        return {}
    pairs: list[tuple[str, str]] = []
    if isinstance(values, str):  # one selection, not its characters
        values = [values]
    if isinstance(values, Mapping):
        pairs = list(values.items())
    else:
        for value in values:
            kind, sep, name = value.partition("=")
            if not sep or not kind.strip() or not name.strip():
                raise PluginError(f"--plugin expects KIND=NAME, got '{value}'")
            pairs.append((kind.strip(), name.strip()))
    selections: dict[str, str] = {}
    for kind, name in pairs:
        if kind not in PLUGIN_KINDS:
            raise PluginError(
                f"unknown plugin kind '{kind}' in --plugin; kinds: {', '.join(PLUGIN_KINDS)}"
            )
        if selections.get(kind, name) != name:
            raise PluginError(
                f"--plugin selects two {kind} plugins, '{selections[kind]}' and '{name}'; give one"
            )
        selections[kind] = name
    return selections


def _load_entry_point_modules(allowed: set[str] | None) -> list[tuple[str, object]]:
    loaded: list[tuple[str, object]] = []
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen or (allowed is not None and ep.name not in allowed):
            continue
        seen.add(ep.name)
        try:
            module = ep.load()
        except Exception as e:  # noqa: BLE001 - re-raised with the plugin's name
            raise PluginError(f"plugin '{ep.name}' ({ep.value}) failed to import: {e}") from e
        loaded.append((ep.name, module))
    return loaded


@cache
def default_host(allow: tuple[str, ...] = ()) -> PluginHost:
    """The process-wide host: entry points are loaded once per process. A non-empty ``allow``
    (``--plugin-allow``) names the third-party plugins that may load; radixserve's own always do.
    """
    if not allow:
        return PluginHost()
    known = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    unknown = sorted(set(allow) - known)
    if unknown:
        raise PluginError(
            f"--plugin-allow names {', '.join(unknown)}, which no installed plugin is; "
            f"installed: {', '.join(sorted(known))}"
        )
    return PluginHost(allow={*allow, *builtin_plugin_names()})


def builtin_plugin_names() -> set[str]:
    """Entry-point plugins that ship inside radixserve itself."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name for ep in eps if ep.value.startswith("radixserve.")}
