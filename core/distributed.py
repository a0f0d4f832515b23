"""An engine's ranks: joining the tensor-parallel group through the hardware plugin, and all the
model runner does differently with more than one rank, behind one object (``Ranks``).

``join`` returns this process's ``Ranks``. The runner asks it for this rank's model config,
builds the model through it (the model plugin's factory gets the group as its ``group``
argument: nothing reads a process-wide group), has it cut the checkpoint to this rank's shard
and wrap the step executor (rank 0 broadcasts each step, ``core/tp_step.py``), and closes it at
shutdown. With one rank every method is the identity or a no-op and nothing is initialised.

How a model splits is ``core/parallel.py``'s; this module owns the process-level side: the
torch.distributed group, the platform's fast all-reduce, the torch thread count a platform may
change for a rank, and leaving the group so that a new engine can start in this process.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, EngineConfig, ModelConfig
from radixserve.core.interfaces import AttentionBackend, CausalLM, HardwarePlatform, ShardedModel
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.parallel import (
    SINGLE,
    FastAllReduce,
    TensorParallel,
    local_model_config,
    pipeline_stage,
    shard_weights,
)
from radixserve.core.pp_step import PipelineStep, gather_stats, model_dtype
from radixserve.core.tp_step import StepBroadcaster, follow_steps, release_step

logger = logging.getLogger(__name__)

#: seconds ``Ranks.close`` waits for the group to close before it gives up on it
TEARDOWN_TIMEOUT_S = 15.0
#: the name of the thread closing a group; alive past the limit means the group is stuck
_CLOSER_THREAD = "tp-teardown"

Step = Callable[[ForwardBatch], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and as which rank one engine process joins its tensor-parallel group."""

    init_method: str  # torch.distributed init method, e.g. "file:///private/dir/store"
    rank: int
    size: int
    #: seconds a collective of a step may wait for the other ranks (then it fails, not hangs)
    timeout_s: float = 300.0
    #: pipeline stages; rank = stage * (size // pp_size) + tensor-parallel rank
    pp_size: int = 1


class Ranks:
    """This engine process's rank among the engine's ranks, as its model runner uses it.

    ``group`` is this rank's tensor-parallel group (what the model plugin is given); ``world``
    holds every rank of the engine (rank 0 broadcasts each step over it). Without pipeline
    parallelism they are one group; with it (``core/pp_step.py``) ``group`` is this stage's
    ranks and says which stage it is (``group.stage``, set by ``local_config``)."""

    def __init__(
        self,
        group: TensorParallel = SINGLE,
        threads_before: int = 0,
        world: TensorParallel | None = None,
        pp_size: int = 1,
    ) -> None:
        self.group = group  # what the model plugin is given
        self.world = group if world is None else world
        self.pp_size = pp_size
        self._threads_before = threads_before  # torch threads before the platform bound a rank
        self.broadcaster: StepBroadcaster | None = None  # rank 0 of several, once leading
        self.pipeline: PipelineStep | None = None  # this stage's step, with pipeline stages
        #: each rank's pipeline stats (rank 0, gathered at close; see PipelineStep.stats)
        self.pipeline_stats: list[dict[str, float]] = []
        self._open = self.world.size > 1

    @property
    def size(self) -> int:
        """All the engine's ranks (tp_size x pp_size)."""
        return self.world.size

    def _sizes(self) -> str:
        if self.pp_size == 1:
            return f"tp_size={self.size}"
        return f"tp_size={self.group.size} x pp_size={self.pp_size}"

    def check_reload(self) -> None:
        """Refuse loading new weights into a running model of more than one rank."""
        if self.size > 1:
            raise ConfigError(f"loading new weights is not supported with {self._sizes()} yet")

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and, with pipeline stages, its stage's
        layers (what the KV pool and attention see); places this rank's stage first."""
        self._model_config = config
        if self.pp_size > 1 and self.group.stage is None:
            self.group.stage = pipeline_stage(
                config.num_layers, self.world.rank // self.group.size, self.pp_size
            )
        return local_model_config(config, self.group)

    def share(self, nbytes: int) -> int:
        """This rank's share of ``nbytes`` of weights."""
        return nbytes // self.size

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank has (e.g. the KV pool size every rank can hold)."""
        return self.world.agree_min(value)

    def build_model(
        self,
        name: str,
        factory: Callable[..., CausalLM],
        config: ModelConfig,
        *args: Any,
    ) -> CausalLM:
        """``factory(config, *args)``, with ``group=`` this rank's group when there are
        several ranks (a factory of one rank's models is called as it always was)."""
        if self.size == 1:
            return factory(config, *args)
        if not _takes_group(factory):
            raise ConfigError(
                f"model plugin '{name}' takes no group argument, so it cannot run with "
                f"{self._sizes()} (docs/plugins.md: tensor parallelism)"
            )
        model = factory(config, *args, group=self.group)
        if self.group.stage is not None and getattr(model, "stage", None) != self.group.stage:
            raise ConfigError(
                f"model plugin '{name}' does not build pipeline stages (its model has no "
                f"'stage' of the group's), so it cannot run with pp_size={self.pp_size}"
            )
        if self.group.ep_size > 1 and not getattr(model, "expert_parallel", False):
            raise ConfigError(
                f"ep_size={self.group.ep_size}: model plugin '{name}' has no experts to spread "
                "(--ep-size is for MoE models: Qwen3-MoE, Mixtral); use --tp-size alone"
            )
        return model

    def shard(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        model: CausalLM,
        name: str,
        config: ModelConfig,
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, cut to this rank's shard by the model's ``tp_plan``."""
        if self.group.size == 1:  # (pipeline stages skip other stages' tensors themselves)
            return weights
        plan = model.tp_plan if isinstance(model, ShardedModel) else None
        if plan is None:
            raise ConfigError(
                f"model plugin '{name}' declares no tp_plan, so it cannot run with "
                f"{self._sizes()} (docs/plugins.md: tensor parallelism)"
            )
        return shard_weights(weights, plan, config, self.group)

    def step_executor(
        self,
        platform: HardwarePlatform,
        model: CausalLM,
        attention: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        config: EngineConfig,
    ) -> Step:
        """The platform's step executor; with pipeline stages its eager one (no captured
        graphs: a stage's output is the residual stream) run micro-batch by micro-batch
        between the stages (``core/pp_step.py``)."""
        if self.pp_size == 1:
            return platform.step_executor(model, attention, kv_pool, req_to_token, config)
        eager = replace(config, disable_cuda_graph=True, enable_torch_compile=False)
        run = platform.step_executor(model, attention, kv_pool, req_to_token, eager)
        stage = self.group.stage
        assert stage is not None
        self.pipeline = PipelineStep(
            run, stage, self.world.rank, self.group.size, self._model_config, model_dtype(model),
            platform.device, platform.synchronize if platform.asynchronous else None,
        )  # fmt: skip
        return self.pipeline

    def lead(self, step: Step, req_to_token: ReqToTokenPool, device: str) -> Step:
        """The step executor rank 0 runs: ``step`` after broadcasting its inputs to the other
        ranks. Other ranks, and a single one, run ``step`` as it is."""
        if self.size == 1 or not self.world.leader:
            return step
        self.broadcaster = StepBroadcaster(self.world, req_to_token, device, step)
        return self.broadcaster

    def follow(self, req_to_token: ReqToTokenPool, kv_pool: KVPool, device: str, step: Step) -> int:
        """A rank other than 0: run each step rank 0 broadcasts until it says stop; the number
        of steps run."""
        steps = follow_steps(self.world, req_to_token, kv_pool, device, step)
        if self.pipeline is not None:
            gather_stats(self.world, self.pipeline)
        return steps

    def close(self, step: Any = None) -> None:
        """Stop the other ranks' step loops (rank 0), let ``step`` free what it captured (CUDA
        graphs holding collectives go before the group does), then leave the group, so a new
        engine can start in this process. A no-op with one rank, or the second time.

        The group is closed on a daemon thread and given up on after ``TEARDOWN_TIMEOUT_S``: a
        shutdown is never a hang (a later tensor-parallel engine in this process is refused
        while it is stuck)."""
        if not self._open:
            return
        self._open = False
        try:
            if self.broadcaster is not None:
                self.broadcaster.stop()
                if self.pipeline is not None:
                    self.pipeline_stats = gather_stats(self.world, self.pipeline)
        except RuntimeError as e:  # a rank already gone: nothing is left to stop there
            logger.warning("could not stop the other tensor-parallel ranks: %s", e)
        finally:
            if step is not None:
                release_step(step)
            torch.set_num_threads(self._threads_before)  # an offline Engine's process goes on
            fast, self.group.fast_all_reduce = self.group.fast_all_reduce, None
            if fast is not None:
                fast.close()
            teardown()


def _takes_group(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call say
        return True
    return any(p.name == "group" or p.kind is p.VAR_KEYWORD for p in params)


def join(platform: HardwarePlatform, config: EngineConfig, rendezvous: Rendezvous | None) -> Ranks:
    """Join the group ``rendezvous`` names (``config.tp_size`` ranks), on the device of its
    rank, through the platform's backend; its fast all-reduce is used where it has one on every
    rank and ``config.disable_custom_all_reduce`` is off. With one rank nothing happens.

    With ``config.pp_size`` stages there are ``tp_size x pp_size`` ranks: rank = stage *
    tp_size + tensor-parallel rank; each stage's ranks form its own tensor-parallel group."""
    size = config.tp_size * config.pp_size
    if size == 1:
        return Ranks()
    if rendezvous is None or rendezvous.size != size:
        raise ConfigError(
            f"tp_size={config.tp_size} x pp_size={config.pp_size} needs one engine process "
            "per rank started together (the server and radixserve.Engine start them)"
        )
    if _stuck():
        raise ConfigError(
            "the tensor-parallel group of an earlier engine in this process did not close; "
            "start a tensor-parallel engine in a new process"
        )
    dist = torch.distributed
    if dist.is_initialized():
        raise ConfigError("this process already runs a tensor-parallel engine; shut it down")
    if sys.platform == "linux" and _on_loopback(rendezvous.init_method):
        # The ranks of one engine share a host and meet on loopback; without this, gloo binds
        # to whatever the hostname resolves to, which fails in containers without one.
        # (Nodes meeting at another address use the interface that reaches it.)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threads_before = torch.get_num_threads()
    per_node = size // config.nnodes  # a rank binds the device (and cores) of its own node
    platform.bind_rank(rendezvous.rank % per_node, per_node)
    backend = platform.distributed_backend()
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    dist.init_process_group(
        backend, init_method=rendezvous.init_method, rank=rendezvous.rank,
        world_size=size, timeout=timeout,
    )  # fmt: skip
    try:
        # Host-side metadata travels over gloo. Its timeout is long on purpose: the other
        # ranks wait in it for the next step while the server idles; a dead rank is noticed by
        # the parent process (its sentinel), not by this timeout.
        cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=30))
        # (the platform's fast all-reduce is peer-to-peer within one host)
        wanted = not config.disable_custom_all_reduce and config.nnodes == 1
        if config.pp_size > 1:
            world = TensorParallel(rendezvous.rank, size, dist.group.WORLD, cpu_group)
            return pipeline_ranks(world, config, threads_before)
        fast = _agreed_fast_all_reduce(platform, dist.group.WORLD, size, cpu_group, wanted)
    except BaseException:
        torch.set_num_threads(threads_before)  # no Ranks will close the group: do it here
        teardown()
        raise
    group = TensorParallel(rendezvous.rank, size, dist.group.WORLD, cpu_group, fast)
    group.ep_size = config.ep_size
    logger.info("tensor-parallel rank %d of %d on %s (%s%s)", rendezvous.rank, size,
                platform.device, backend,
                f", small all-reduces: {type(fast).__name__}" if fast else "")  # fmt: skip
    return Ranks(group, threads_before)


def pipeline_ranks(world: TensorParallel, config: EngineConfig, threads_before: int) -> Ranks:
    """This rank's Ranks with ``config.pp_size`` pipeline stages, once every rank joined
    ``world``: its stage's tensor-parallel group beside the world's."""
    stage_group = stage_groups(world.rank, config.tp_size, config.pp_size)
    logger.info("engine rank %d of %d: pipeline stage %d of %d, tensor-parallel rank %d of %d",
                world.rank, world.size, world.rank // config.tp_size, config.pp_size,
                stage_group.rank, config.tp_size)  # fmt: skip
    return Ranks(stage_group, threads_before, world, config.pp_size)


def stage_groups(rank: int, tp_size: int, pp_size: int) -> TensorParallel:
    """This rank's stage's tensor-parallel group (every rank creates every stage's groups, in
    the same order, as torch.distributed requires). No platform fast all-reduce here yet."""
    dist = torch.distributed
    mine = None
    for stage in range(pp_size):
        members = [stage * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks=members)
        cpu = dist.new_group(ranks=members, backend="gloo", timeout=datetime.timedelta(days=30))
        if rank in members:
            mine = TensorParallel(rank - members[0], tp_size, group, cpu)
    assert mine is not None
    return mine


def _on_loopback(init_method: str) -> bool:
    """A file store (one host), or a TCP store on a loopback address."""
    url = urllib.parse.urlsplit(init_method)
    if url.scheme == "file":
        return True
    host = url.hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _agreed_fast_all_reduce(
    platform: HardwarePlatform, group: Any, size: int, cpu_group: Any, wanted: bool
) -> FastAllReduce | None:
    """The platform's fast all-reduce if every rank built one, else None on every rank (a
    rank that summed some tensors another way would wait forever in a different kernel)."""
    fast = None
    if wanted:
        try:
            fast = platform.fast_all_reduce(group, size)
        except Exception as e:  # noqa: BLE001 - the backend's all-reduce still works
            logger.warning("custom all-reduce unavailable, %s's is used: %s",
                           platform.distributed_backend(), e)  # fmt: skip
    have = torch.tensor([int(fast is not None)], dtype=torch.int64)
    torch.distributed.all_reduce(have, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    if fast is not None and not have.item():
        logger.warning("custom all-reduce off: another rank could not set it up")
        fast.close()
        fast = None
    return fast


def _stuck() -> bool:
    """An earlier group's closing thread is still running (it did not close in time)."""
    return any(t.name == _CLOSER_THREAD and t.is_alive() for t in threading.enumerate())


def teardown() -> None:
    """Leave the torch.distributed group this process is in, if any (``Ranks.close`` calls it;
    so does a caller whose engine failed to start after joining). Gives up on a group that has
    not closed after ``TEARDOWN_TIMEOUT_S`` and leaves it open."""
    if not torch.distributed.is_initialized():
        return
    closer = threading.Thread(
        target=torch.distributed.destroy_process_group, name=_CLOSER_THREAD, daemon=True
    )
    closer.start()
    closer.join(TEARDOWN_TIMEOUT_S)
    if closer.is_alive():
        logger.error("the tensor-parallel group did not close in %.0f s; left open",
                     TEARDOWN_TIMEOUT_S)  # fmt: skip
