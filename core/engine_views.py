"""What the entrypoints read and ask of an EngineCore: the offline Engine and the server's
engine process use these methods, never the core's parts (scheduler, runner, grammar queue,
step strategies) directly. A base class of EngineCore, kept apart so the loop's file holds the
loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.core.disaggregation import connector_of, side_of
from radixserve.core.multimodal_strategy import multimodal_of
from radixserve.core.spec_strategy import speculator_of

if TYPE_CHECKING:
    from radixserve.core.config import EngineConfig
    from radixserve.core.grammar_queue import GrammarQueue
    from radixserve.core.model_runner import ModelRunner
    from radixserve.core.scheduler import Scheduler
    from radixserve.core.strategy_list import StrategyList


class EngineViews:
    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    grammars: GrammarQueue
    strategies: StrategyList
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def kv_size(self) -> int:
        """Token slots in the KV pool."""
        return self.runner.kv_size

    @property
    def max_running_requests(self) -> int:
        return self.runner.settings.max_running_requests

    def settings_summary(self) -> dict[str, dict[str, Any]]:
        """The resolved runtime settings, as the start-up banner and /server_info show them."""
        return self.runner.settings.describe()

    def numerics(self) -> str:
        """What the engine computes with, as resolved (the CPU's fast mode among the choices),
        e.g. "gguf weights, float16 KV, eager decode"."""
        weights = self.config.quantization or str(self.runner.dtype).removeprefix("torch.")
        kv = str(self.runner.kv_dtype).removeprefix("torch.")
        steps = "compiled decode" if self.config.enable_torch_compile else "eager decode"
        mode = ", deterministic" if self.config.enable_deterministic_inference else ""
        return f"{weights} weights, {kv} KV, {steps}{mode}"

    def plugin_names(self) -> dict[str, str]:
        """Plugin kind -> the name of the plugin chosen for it."""
        return dict(self.runner.plugins.names)

    @property
    def spec_num_draft(self) -> int | None:
        """Draft tokens per request and verify step; None when speculation is off."""
        speculator = speculator_of(self)
        return None if speculator is None else speculator.num_draft

    @property
    def num_grammar_queue(self) -> int:
        """Requests waiting for their grammar to compile."""
        return len(self.grammars)

    def isolate_grammar_compiles(self) -> None:
        """Compile each new grammar in a capped sandbox process first (core/grammar_sandbox.py),
        so that no request's grammar can take the engine's time or memory."""
        from radixserve.core.grammar_sandbox import SandboxSpec  # here: a server's choice

        grammars, config = self.grammars, self.config
        if grammars.backend_name == "none":
            return  # it refuses every grammar at once
        grammars.isolate(
            SandboxSpec(
                backend=grammars.backend_name,
                model_dir=str(config.model_path),
                vocab_size=self.vocab_size,
                stop_token_ids=tuple(self.eos_token_ids),
                plugin_allow=tuple(config.plugin_allow),
                memory_mb=config.grammar_compile_memory,
            )
        )

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running_rids(self) -> list[str]:
        """The running requests' ids, in the scheduler's order."""
        return [req.rid for req in self.scheduler.running]

    def kv_accounting(self) -> dict[str, int]:
        return self.scheduler.kv_accounting()

    def scheduler_counters(self) -> dict[str, Any]:
        """The scheduler's counters since start: cache_hit_rate, retractions (preemptions:
        those for a higher priority), per-priority counts, steps and steps_by_kind (each
        kind's counts as JSON)."""
        stats = self.scheduler.stats
        return {
            "cache_hit_rate": stats.cache_hit_rate,
            "hicache": self.scheduler.cache.tier_stats(),
            "multimodal": None if (mm := multimodal_of(self)) is None else mm.stats(),
            "retractions": stats.retractions,
            "preemptions": stats.preemptions,
            "priorities": self.scheduler.priority.to_json(),
            "steps": stats.steps,
            "steps_by_kind": {k: v.to_json() for k, v in stats.by_kind.items()},
        }

    @property
    def wakeup_fd(self) -> int | None:
        """A descriptor that becomes readable when a KV transfer ends (disaggregation), for
        the caller to wait on beside its inbox; None without one."""
        connector = connector_of(self)
        return None if connector is None else connector.wakeup_fd

    def bind_server_engine(self) -> None:
        """Let the hardware platform place this process as a server's engine."""
        self.runner.platform.bind_server_engine()

    def close_transfers(self) -> None:
        """Close the KV connector (its server and transfer agent, in order), if there is one;
        once: its strategy leaves the engine, so shutdown does not close it again."""
        side = side_of(self)
        if side is not None:
            self.strategies.remove(side)
            side.close()

    def close_runner(self) -> None:
        """The engine's other ranks leave their step loops."""
        self.runner.close()
