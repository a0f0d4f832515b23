"""EngineConfig's own logic (core/config.py), engine-free: the plugin aliases merged into
``plugins``, the draft sizes derived from the speculative flags, the platform defaults filled
in with where each came from, and the flags' help (the checks: test_config_checks.py)."""

from __future__ import annotations

import pytest

from radixserve.core.config import CORE_DEFAULTS, ConfigError, EngineConfig


def test_each_alias_flag_becomes_its_plugin_selection_lowercased() -> None:
    cfg = EngineConfig(grammar_backend="xgrammar", speculative_algorithm="NGRAM",
                       disaggregation_mode="prefill",
                       disaggregation_transfer_backend="TCP")  # fmt: skip
    assert cfg.plugins == ("kv_transfer=tcp", "grammar=xgrammar", "speculative=ngram")
    tiers = EngineConfig(hicache_storage_backend="File", enable_hierarchical_cache=True)
    assert tiers.plugins == ("hicache_storage=file",)
    assert EngineConfig().plugins == ()  # no alias given: nothing added
    # the transfer backend's alias counts only with disaggregation on
    assert EngineConfig(disaggregation_transfer_backend="TCP").plugins == ()


def test_an_alias_agreeing_with_the_plugin_flag_adds_nothing_a_conflict_is_refused() -> None:
    same = EngineConfig(plugins=("grammar=xgrammar", "attention=torch_native"),
                        grammar_backend="xgrammar")  # fmt: skip
    assert same.plugins == ("grammar=xgrammar", "attention=torch_native")
    spaced = EngineConfig(plugins=("speculative= ngram ",), speculative_algorithm="ngram")
    assert spaced.plugins == ("speculative= ngram ",)
    with pytest.raises(ConfigError) as err:
        EngineConfig(plugins=("grammar=outlines",), grammar_backend="xgrammar")
    assert str(err.value) == (
        "grammar_backend 'xgrammar' conflicts with --plugin grammar=outlines; give one"
    )
    with pytest.raises(ConfigError) as err:
        EngineConfig(plugins=("grammar=xgrammar", "grammar=llguidance"), grammar_backend="xgrammar")
    assert str(err.value).endswith("conflicts with --plugin grammar=llguidance; give one")
    # a kind whose name only starts like another's is not that kind
    other = EngineConfig(plugins=("grammarx=y",), grammar_backend="xgrammar")
    assert other.plugins == ("grammarx=y", "grammar=xgrammar")


def test_draft_sizes_follow_the_speculative_flags() -> None:
    def sizes(**kw: int) -> tuple[int, int, int]:
        cfg = EngineConfig(**kw)
        return cfg.num_draft_tokens, cfg.tree_nodes, cfg.draft_depth

    assert sizes() == (4, 0, 4)  # a chain of the default 4 steps
    assert sizes(speculative_num_steps=3) == (3, 0, 3)
    assert sizes(speculative_num_draft_tokens=6) == (5, 0, 5)  # the target's own token off
    assert sizes(speculative_num_steps=2, speculative_num_draft_tokens=6) == (5, 0, 5)
    # a tree: depth from the steps, nodes from the draft tokens or depth x top-k
    assert sizes(speculative_eagle_topk=2) == (8, 8, 4)
    assert sizes(speculative_eagle_topk=3, speculative_num_steps=2) == (6, 6, 2)
    assert sizes(speculative_eagle_topk=2, speculative_num_steps=2,
                 speculative_num_draft_tokens=6) == (5, 5, 2)  # fmt: skip


def test_platform_defaults_fill_only_what_was_left_unset_and_say_from_where() -> None:
    names = list(CORE_DEFAULTS)
    given, caller, platform = names[0], names[1], names[2]
    cfg = EngineConfig(**{given: CORE_DEFAULTS[given]})
    chosen = {caller: CORE_DEFAULTS[caller], platform: CORE_DEFAULTS[platform]}
    filled, settings = cfg.with_platform_defaults(
        "cuda", chosen, ("offline Engine", {caller: CORE_DEFAULTS[caller], given: None})
    )
    assert settings.origins[given] == "flag"
    assert settings.origins[caller] == "offline Engine default"
    assert settings.origins[platform] == "cuda default"
    assert all(settings.origins[n] == "default" for n in names[3:])
    assert set(settings.origins) == set(CORE_DEFAULTS)
    for name in names:
        assert getattr(filled, name) == getattr(settings, name) is not None, name
    assert getattr(cfg, caller) is None  # the config itself stays as given
    # without a caller's defaults the platform's apply, then the core's
    _, plain = cfg.with_platform_defaults("cpu", {caller: CORE_DEFAULTS[caller]})
    assert plain.origins[caller] == "cpu default" and plain.origins[platform] == "default"
    with pytest.raises(ConfigError) as err:
        cfg.with_platform_defaults("npu", {"warp_speed": 9, "zeal": 1})
    assert str(err.value) == "platform 'npu' sets unknown defaults: ['warp_speed', 'zeal']"


def test_every_flag_has_its_help() -> None:
    helps = EngineConfig.field_help()
    assert helps["plugins"] == "Plugin selection KIND=NAME (repeatable)"
    assert helps["mm_encoder_cache_mb"] == "MiB of vision-encoder outputs kept by image hash"
    assert all(helps.values()) and "model_path" in helps


def test_each_alias_conflict_names_its_own_flag() -> None:
    cases = [
        ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "tcp"},
         "kv_transfer", "disaggregation_transfer_backend 'tcp'"),
        ({"speculative_algorithm": "ngram"}, "speculative", "speculative_algorithm 'ngram'"),
        ({"hicache_storage_backend": "file", "enable_hierarchical_cache": True},
         "hicache_storage", "hicache_storage_backend 'file'"),
    ]  # fmt: skip
    for kw, kind, flag in cases:
        with pytest.raises(ConfigError) as err:
            EngineConfig(plugins=(f"{kind}=other",), **kw)
        assert str(err.value) == f"{flag} conflicts with --plugin {kind}=other; give one"
    # the name is everything after the kind's "="
    same = EngineConfig(plugins=("grammar=a=b",), grammar_backend="a=b")
    assert same.plugins == ("grammar=a=b",)
