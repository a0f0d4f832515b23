"""An engine's ranks (core/distributed.py) without processes: the model plugin builds this rank's
share for the group it is given (two ranks' models side by side in one process, as no
process-wide group would allow), a factory of one rank's models is called as it always was, and
one that cannot take a group is refused with a line naming it."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.distributed import Ranks
from radixserve.core.memory import KVPool
from radixserve.core.parallel import TensorParallel
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.models.llama import build_llama
from radixserve.plugins.models.parallel_layers import RowParallelLinear


def _config(layers: int = 2) -> ModelConfig:
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=6,
               num_key_value_heads=3, head_dim=4, num_hidden_layers=layers, vocab_size=11,
               intermediate_size=7, max_position_embeddings=64)  # fmt: skip
    return ModelConfig.from_dict(raw)


def _build(ranks: Ranks, factory: Any = build_llama) -> Any:
    local = ranks.local_config(_config())
    pool = KVPool(16, local.num_layers, local.num_kv_heads, local.head_dim, torch.float32, "cpu")
    attention = TorchNativeAttention(pool, local, "cpu")
    name = "LlamaForCausalLM"
    return ranks.build_model(name, factory, _config(), attention, torch.float32, "cpu")


def test_each_rank_model_is_built_for_the_group_it_is_given() -> None:
    groups = [TensorParallel(rank, 2) for rank in range(2)]
    models = [_build(Ranks(g)) for g in groups]  # both in this one process
    for model, group, (heads, kv_heads, inter) in zip(
        models, groups, [(2, 1, 3), (4, 2, 4)], strict=True
    ):
        assert model.tp is group
        assert model.embed_tokens.tp is group
        assert model.lm_head.weight.shape[0] == 6  # ceil(11 / 2) vocabulary rows
        for layer in model.layers:
            assert layer.tp is group and (layer.num_heads, layer.num_kv_heads) == (heads, kv_heads)
            assert layer.qkv_proj.weight.shape[0] == (heads + 2 * kv_heads) * 4
            assert isinstance(layer.o_proj, RowParallelLinear) and layer.o_proj.tp is group
            assert layer.o_proj.weight.shape == (32, heads * 4)
            assert layer.down_proj.tp is group and layer.intermediate_size == inter


def test_one_rank_calls_the_factory_as_it_always_was() -> None:
    calls: list[tuple[int, dict[str, Any]]] = []

    def factory(config: ModelConfig, *args: Any, **kw: Any) -> Any:
        calls.append((len(args), kw))
        return build_llama(config, *args, **kw)

    model = _build(Ranks(), factory)
    assert calls == [(3, {})]  # (attention, dtype, device), no group keyword
    assert model.tp.size == 1 and model.layers[0].num_heads == 6


def test_a_factory_that_takes_no_group_is_refused_with_several_ranks() -> None:
    def old_factory(config: ModelConfig, attention: Any, dtype: Any, device: str) -> Any:
        raise AssertionError("must not be called")

    with pytest.raises(ConfigError, match="model plugin 'LlamaForCausalLM' takes no group"):
        _build(Ranks(TensorParallel(0, 2)), old_factory)
    # one rank: the same factory is called as it always was
    with pytest.raises(AssertionError, match="must not be called"):
        _build(Ranks(), old_factory)


# ---- Ranks' other methods and join, on fake collectives (no process group) ----------------


class Platform:
    """A hardware platform's distributed side, recording what join and Ranks ask of it."""

    device = "cpu"
    asynchronous = False

    def __init__(self, fast: Any = None) -> None:
        self.fast = fast
        self.calls: list[tuple[Any, ...]] = []

    def bind_rank(self, rank: int, per_node: int) -> None:
        self.calls.append(("bind_rank", rank, per_node))

    def distributed_backend(self) -> str:
        return "gloo"

    def fast_all_reduce(self, group: Any, size: int) -> Any:
        self.calls.append(("fast_all_reduce", group, size))
        return self.fast

    def step_executor(self, *args: Any) -> Any:
        self.calls.append(("step_executor", *args))
        return "step"

    def synchronize(self) -> None:
        pass


class FakeDist:
    """torch.distributed's group calls, recorded (monkeypatched in by ``fake_dist``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.initialized = False
        self.have_fast = 1  # what the other ranks answer to the fast all-reduce agreement

    def init_process_group(self, backend: str, **kw: Any) -> None:
        self.calls.append(("init", backend, kw))
        self.initialized = True

    def new_group(self, ranks: Any = None, backend: Any = None, timeout: Any = None) -> Any:
        self.calls.append(("new_group", ranks, backend, timeout))
        return f"group{len(self.calls)}"

    def all_reduce(self, x: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.calls.append(("all_reduce", op, group))
        x.fill_(min(int(x.item()), self.have_fast))

    def destroy_process_group(self) -> None:
        self.calls.append(("destroy",))
        self.initialized = False


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> FakeDist:
    fake = FakeDist()
    dist = torch.distributed
    for name in ("init_process_group", "new_group", "all_reduce", "destroy_process_group"):
        monkeypatch.setattr(dist, name, getattr(fake, name))
    monkeypatch.setattr(dist, "is_initialized", lambda: fake.initialized)
    monkeypatch.setattr(dist.distributed_c10d._world, "default_pg", "world")  # group.WORLD
    # set, then removed: undoing both leaves the variable as it was, also where join set it
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    threads = torch.get_num_threads()
    yield fake
    torch.set_num_threads(threads)


def _engine_config(**kw: Any) -> Any:
    from radixserve.core.config import EngineConfig

    return EngineConfig(**kw)


def test_one_rank_is_the_identity_everywhere() -> None:
    ranks = Ranks()
    assert ranks.size == 1 and ranks.world is ranks.group and ranks.pp_size == 1
    ranks.check_reload()  # allowed
    assert ranks.share(10) == 10 and ranks.agree_min(7) == 7
    weights = [("w", torch.ones(2))]
    assert ranks.shard(weights, object(), "m", _config()) is weights  # type: ignore[arg-type]
    assert ranks.lead("step", "table", "cpu") == "step"  # type: ignore[arg-type]
    assert ranks.broadcaster is None
    ranks.close()  # nothing to leave


def test_several_ranks_refuse_a_reload_naming_their_sizes() -> None:
    with pytest.raises(ConfigError) as e:
        Ranks(TensorParallel(0, 2)).check_reload()
    assert str(e.value) == "loading new weights is not supported with tp_size=2 yet"
    pp = Ranks(TensorParallel(0, 2), world=TensorParallel(0, 6), pp_size=3)
    assert pp.size == 6
    with pytest.raises(ConfigError) as e:
        pp.check_reload()
    assert str(e.value) == "loading new weights is not supported with tp_size=2 x pp_size=3 yet"
    # one rank per stage: the weights' share is the world's, the checkpoint is not cut
    one_per_stage = Ranks(TensorParallel(0, 1), world=TensorParallel(1, 2), pp_size=2)
    assert one_per_stage.share(11) == 5 and type(one_per_stage.share(11)) is int
    weights = [("w", torch.ones(2))]
    assert one_per_stage.shard(weights, object(), "m", _config()) is weights  # type: ignore[arg-type]


def test_the_kv_pool_size_is_agreed_over_every_rank(fake_dist: FakeDist) -> None:
    fake_dist.have_fast = 3  # the smallest value another rank has
    world = TensorParallel(1, 4, cpu_group="world-cpu")
    ranks = Ranks(TensorParallel(1, 2, cpu_group="stage-cpu"), world=world, pp_size=2)
    assert ranks.agree_min(9) == 3 and ranks.agree_min(2) == 2
    assert fake_dist.calls[0] == ("all_reduce", torch.distributed.ReduceOp.MIN, "world-cpu")


def test_a_stage_rank_gets_its_stage_first_and_its_layers() -> None:
    from radixserve.core.parallel import pipeline_stage

    config = _config(layers=5)
    group = TensorParallel(1, 2)
    ranks = Ranks(group, world=TensorParallel(3, 6), pp_size=3)  # world rank 3: stage 1
    local = ranks.local_config(config)
    assert group.stage == pipeline_stage(5, 1, 3)
    assert group.stage.layers.size == 2 and local.num_layers == 2
    assert (local.num_heads, local.num_kv_heads) == (4, 2)  # rank 1's share of 6 and 3 heads
    group.stage = pipeline_stage(5, 2, 3)  # placed already: kept
    ranks.local_config(config)
    assert group.stage == pipeline_stage(5, 2, 3)
    plain = TensorParallel(0, 2)
    Ranks(plain).local_config(config)
    assert plain.stage is None  # no pipeline: no stage


def _model_factory(**attrs: Any) -> Any:
    def factory(config: ModelConfig, *args: Any, group: Any = None) -> Any:
        return type("Model", (), {"group": group, "args": args, **attrs})()

    return factory


def test_a_pipeline_model_must_build_its_stage_and_experts_need_a_moe() -> None:
    from radixserve.core.parallel import pipeline_stage

    group = TensorParallel(0, 2, stage=pipeline_stage(4, 1, 2))
    ranks = Ranks(group, world=TensorParallel(2, 4), pp_size=2)
    model = ranks.build_model("m", _model_factory(stage=pipeline_stage(4, 1, 2)), _config(), 1, 2)
    assert model.group is group and model.args == (1, 2)
    with pytest.raises(ConfigError) as e:
        ranks.build_model("m", _model_factory(stage=pipeline_stage(4, 0, 2)), _config())
    assert str(e.value) == (
        "model plugin 'm' does not build pipeline stages (its model has no 'stage' of the "
        "group's), so it cannot run with pp_size=2"
    )
    with pytest.raises(ConfigError, match="does not build pipeline stages"):
        ranks.build_model("m", _model_factory(), _config())  # no stage at all
    experts = TensorParallel(0, 2)
    experts.ep_size = 2
    moe = Ranks(experts).build_model("q", _model_factory(expert_parallel=True), _config())
    assert moe.group is experts
    with pytest.raises(ConfigError) as e:
        Ranks(experts).build_model("q", _model_factory(), _config())
    assert str(e.value) == (
        "ep_size=2: model plugin 'q' has no experts to spread (--ep-size is for MoE models: "
        "Qwen3-MoE, Mixtral); use --tp-size alone"
    )
    dense = Ranks(TensorParallel(1, 2)).build_model("d", _model_factory(), _config())
    assert dense.group.rank == 1  # ep_size 1: no experts needed


def test_a_factory_taking_keywords_or_without_a_signature_gets_the_group() -> None:
    from radixserve.core.distributed import _takes_group

    assert _takes_group(lambda config, group: None)
    assert _takes_group(lambda config, **kw: None)
    assert not _takes_group(lambda config, *args: None)
    assert not _takes_group(lambda config, groups=None: None)
    assert _takes_group(max)  # a builtin without a signature: the call itself says


def test_a_model_without_a_tp_plan_cannot_be_sharded() -> None:
    ranks = Ranks(TensorParallel(0, 2))
    no_plan = type("M", (), {"tp_plan": None})()
    for model in (no_plan, object()):
        with pytest.raises(ConfigError) as e:
            list(ranks.shard([("w", torch.ones(4))], model, "m", _config()))  # type: ignore[arg-type]
        assert str(e.value) == (
            "model plugin 'm' declares no tp_plan, so it cannot run with tp_size=2 "
            "(docs/plugins.md: tensor parallelism)"
        )
    planned = type("M", (), {"tp_plan": {"*.weight": "column"}})()
    shards = dict(ranks.shard([("x.weight", torch.arange(8.0).reshape(4, 2))], planned, "m",
                              _config()))  # fmt: skip
    assert shards["x.weight"].tolist() == [[0.0, 1.0], [2.0, 3.0]]  # rank 0's half of the rows


def test_pipeline_stages_run_the_platforms_eager_step_between_them() -> None:
    from radixserve.core.config import EngineConfig
    from radixserve.core.parallel import pipeline_stage
    from radixserve.core.pp_step import PipelineStep

    platform = Platform()
    config = EngineConfig(enable_torch_compile=True)
    one = Ranks(TensorParallel(0, 2))
    assert one.step_executor(platform, "model", "attn", "kv", "table", config) == "step"  # type: ignore[arg-type]
    assert platform.calls[-1] == ("step_executor", "model", "attn", "kv", "table", config)
    assert one.pipeline is None
    group = TensorParallel(1, 2)
    ranks = Ranks(group, world=TensorParallel(3, 4), pp_size=2)
    ranks.local_config(_config(layers=4))
    model = torch.nn.Linear(2, 2).to(torch.float64)
    step = ranks.step_executor(platform, model, "attn", "kv", "table", config)  # type: ignore[arg-type]
    assert isinstance(step, PipelineStep) and ranks.pipeline is step
    assert platform.calls[-1][:5] == ("step_executor", model, "attn", "kv", "table")
    eager = platform.calls[-1][-1]
    assert eager.disable_cuda_graph is True and eager.enable_torch_compile is False
    assert eager.max_total_tokens == config.max_total_tokens
    assert step.run == "step" and step.stage == pipeline_stage(4, 1, 2) == group.stage
    assert (step.rank, step.prev, step.next) == (3, 1, None)
    assert step.hidden == (32, torch.float64) and step.synchronize is None
    assert step.device == "cpu"
    platform.asynchronous = True
    synced = Ranks(TensorParallel(0, 2), world=TensorParallel(0, 4), pp_size=2)
    synced.local_config(_config(layers=4))
    first = synced.step_executor(platform, model, "a", "k", "t", config)  # type: ignore[arg-type]
    assert first.synchronize == platform.synchronize and first.next == 2


def test_rank_0_of_several_leads_the_others_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.core import distributed
    from radixserve.core.memory import ReqToTokenPool
    from radixserve.core.tp_step import StepBroadcaster

    table = ReqToTokenPool(2, 8)
    follower = Ranks(TensorParallel(1, 2))
    assert follower.lead("step", table, "cpu") == "step"  # type: ignore[arg-type]
    leader = Ranks(TensorParallel(0, 2))
    lead = leader.lead("step", table, "cpu")  # type: ignore[arg-type]
    assert isinstance(lead, StepBroadcaster) and leader.broadcaster is lead
    assert lead.tp is leader.world and lead.run == "step" and lead.on_host
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(distributed, "follow_steps", lambda *a: calls.append(("follow", *a)) or 5)
    monkeypatch.setattr(distributed, "gather_stats", lambda *a: calls.append(("gather", *a)))
    assert follower.follow(table, "kv", "cpu", "step") == 5  # type: ignore[arg-type]
    assert calls == [("follow", follower.world, table, "kv", "cpu", "step")]
    follower.pipeline = "pipeline"  # type: ignore[assignment]
    follower.follow(table, "kv", "cpu", "step")  # type: ignore[arg-type]
    assert calls[-1] == ("gather", follower.world, "pipeline")


class Stoppable:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1
        if self.error is not None:
            raise self.error


class Closable:
    closed = 0

    def close(self) -> None:
        self.closed += 1

    def __call__(self, x: torch.Tensor) -> bool:
        return False


@pytest.mark.parametrize("stop_fails", [False, True])
def test_close_stops_the_followers_releases_the_step_and_leaves_the_group(
    fake_dist: FakeDist,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stop_fails: bool,
) -> None:
    from radixserve.core import distributed

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(distributed, "release_step", lambda s: calls.append(("release", s)))
    monkeypatch.setattr(distributed, "gather_stats", lambda w, p: [{"world": w, "step": p}])
    fake_dist.initialized = True
    fast = Closable()
    group = TensorParallel(0, 2, fast_all_reduce=fast)
    before = torch.get_num_threads()
    ranks = Ranks(group, threads_before=max(1, before - 1) if before > 1 else 2)
    ranks.broadcaster = Stoppable(RuntimeError("rank 1 is gone") if stop_fails else None)  # type: ignore[assignment]
    ranks.pipeline = "pipeline"  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="radixserve.core.distributed"):
        ranks.close("the step")
    assert ranks.broadcaster.stopped == 1  # type: ignore[union-attr]
    gathered = [{"world": ranks.world, "step": "pipeline"}]
    assert ranks.pipeline_stats == ([] if stop_fails else gathered)
    warned = ["could not stop the other tensor-parallel ranks: rank 1 is gone"]
    assert [r.getMessage() for r in caplog.records] == (warned if stop_fails else [])
    assert calls == [("release", "the step")]
    assert torch.get_num_threads() == ranks._threads_before
    assert fast.closed == 1 and group.fast_all_reduce is None
    assert fake_dist.calls == [("destroy",)] and not fake_dist.initialized
    ranks.close("the step")  # the second time: nothing
    assert ranks.broadcaster.stopped == 1 and len(calls) == 1  # type: ignore[union-attr]
    quiet = Ranks(TensorParallel(0, 2), threads_before=before)
    quiet.close()  # no broadcaster, no step, no fast all-reduce
    assert calls == [("release", "the step")]


def test_teardown_leaves_only_a_group_that_exists(
    fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from radixserve.core.distributed import teardown

    teardown()
    assert fake_dist.calls == []
    fake_dist.initialized = True
    closers: list[threading.Thread] = []
    monkeypatch.setattr(
        torch.distributed,
        "destroy_process_group",
        lambda: closers.append(threading.current_thread()),
    )
    teardown()
    # on a daemon thread of its own: a group that never closes cannot hold the process
    assert [(t.name, t.daemon) for t in closers] == [("tp-teardown", True)]


def test_a_group_that_does_not_close_is_named_in_the_log(
    fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    from radixserve.core import distributed

    release = threading.Event()
    fake_dist.initialized = True
    monkeypatch.setattr(torch.distributed, "destroy_process_group", release.wait)
    monkeypatch.setattr(distributed, "TEARDOWN_TIMEOUT_S", 0.05)
    try:
        with caplog.at_level(logging.ERROR, logger="radixserve.core.distributed"):
            distributed.teardown()
    finally:
        release.set()
    assert [r.getMessage() for r in caplog.records] == [
        "the tensor-parallel group did not close in 0 s; left open"
    ]
    for t in threading.enumerate():
        if t.name == distributed._CLOSER_THREAD:
            t.join(5)


def test_loopback_rendezvous() -> None:
    from radixserve.core.distributed import _on_loopback

    assert _on_loopback("file:///tmp/store")
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "[::1]"):
        assert _on_loopback(f"tcp://{host}:29500"), host
    for host in ("10.0.0.1", "128.0.0.1", "myhost", "[::2]"):
        assert not _on_loopback(f"tcp://{host}:29500"), host
    assert not _on_loopback("env://")


def test_join_refuses_without_a_rendezvous_of_every_rank(fake_dist: FakeDist) -> None:
    from radixserve.core.distributed import Rendezvous, join

    assert join(Platform(), _engine_config(), None).size == 1  # one rank: nothing to join
    assert fake_dist.calls == []
    config = _engine_config(tp_size=2, pp_size=2)
    want = (
        "tp_size=2 x pp_size=2 needs one engine process per rank started together (the server "
        "and radixserve.Engine start them)"
    )
    for rendezvous in (None, Rendezvous("file:///x", 0, 2)):
        with pytest.raises(ConfigError) as e:
            join(Platform(), config, rendezvous)  # type: ignore[arg-type]
        assert str(e.value) == want
    fake_dist.initialized = True
    with pytest.raises(ConfigError) as e:
        join(Platform(), config, Rendezvous("file:///x", 0, 4))  # type: ignore[arg-type]
    assert str(e.value) == "this process already runs a tensor-parallel engine; shut it down"
    assert fake_dist.calls == []


@pytest.mark.parametrize("other_has_fast", [1, 0])
def test_join_a_tensor_parallel_group(
    fake_dist: FakeDist,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    other_has_fast: int,
) -> None:
    import datetime
    import os

    from radixserve.core.distributed import Rendezvous, join

    fake_dist.have_fast = other_has_fast
    fast = Closable()
    platform = Platform(fast)
    config = _engine_config(tp_size=4, ep_size=4, nnodes=2, dist_init_addr="127.0.0.1:1234")
    monkeypatch.setattr(sys, "platform", "linux")
    threads = torch.get_num_threads()
    rendezvous = Rendezvous("tcp://127.0.0.1:1234", 3, 4, timeout_s=9.0)
    with caplog.at_level(logging.INFO, logger="radixserve.core.distributed"):
        ranks = join(platform, config, rendezvous)  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == ["tensor-parallel rank 3 of 4 on cpu (gloo)"]
    assert ranks._threads_before == threads
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    bind = platform.calls[0]  # rank 3 is the second of its node's two
    assert bind == ("bind_rank", 1, 2) and [type(v) for v in bind[1:]] == [int, int]
    assert fake_dist.calls[0] == ("init", "gloo", {"init_method": "tcp://127.0.0.1:1234",
                                  "rank": 3, "world_size": 4,
                                  "timeout": datetime.timedelta(seconds=9.0)})  # fmt: skip
    assert fake_dist.calls[1] == ("new_group", None, "gloo", datetime.timedelta(days=30))
    group = ranks.group
    assert (group.rank, group.size, group.group, group.cpu_group) == (3, 4, "world", "group2")
    assert group.ep_size == 4 and ranks.world is group and ranks.pp_size == 1
    # nnodes 2: the platform's fast all-reduce is not asked (it is within one host)
    assert not any(c[0] == "fast_all_reduce" for c in platform.calls)
    assert group.fast_all_reduce is None
    fake_dist.initialized = False
    one_host = _engine_config(tp_size=2)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="radixserve.core.distributed"):
        ranks = join(platform, one_host, Rendezvous("file:///x", 1, 2))  # type: ignore[arg-type]
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice stays
    assert platform.calls[-2:] == [("bind_rank", 1, 2), ("fast_all_reduce", "world", 2)]
    assert fake_dist.calls[-1] == ("all_reduce", torch.distributed.ReduceOp.MIN, "group5")
    assert ranks.group.fast_all_reduce is (fast if other_has_fast else None)
    assert [r.getMessage() for r in caplog.records] == (
        ["tensor-parallel rank 1 of 2 on cpu (gloo, small all-reduces: Closable)"]
        if other_has_fast
        else [
            "custom all-reduce off: another rank could not set it up",
            "tensor-parallel rank 1 of 2 on cpu (gloo)",
        ]  # fmt: skip
    )
    fake_dist.initialized = False
    off = _engine_config(tp_size=2, disable_custom_all_reduce=True)
    ranks = join(platform, off, Rendezvous("file:///x", 0, 2))  # type: ignore[arg-type]
    assert platform.calls[-1][0] == "bind_rank" and ranks.group.fast_all_reduce is None


def test_join_off_loopback_leaves_the_interface_to_gloo(
    fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from radixserve.core.distributed import Rendezvous, join

    monkeypatch.setattr(sys, "platform", "linux")
    join(Platform(), _engine_config(tp_size=2), Rendezvous("tcp://10.1.2.3:5", 0, 2))  # type: ignore[arg-type]
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    fake_dist.initialized = False
    monkeypatch.setattr(sys, "platform", "darwin")
    join(Platform(), _engine_config(tp_size=2), Rendezvous("file:///x", 0, 2))  # type: ignore[arg-type]
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_join_that_fails_after_the_group_formed_leaves_it(
    fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.core.distributed import Rendezvous, join

    before = torch.get_num_threads()

    class Binding(Platform):
        def bind_rank(self, rank: int, per_node: int) -> None:
            torch.set_num_threads(before + 1)  # the platform changes the rank's threads

        def fast_all_reduce(self, group: Any, size: int) -> Any:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        join(Binding(), _engine_config(tp_size=2), Rendezvous("file:///x", 0, 2))  # type: ignore[arg-type]
    assert torch.get_num_threads() == before
    assert fake_dist.calls[-1] == ("destroy",) and not fake_dist.initialized


def test_join_with_pipeline_stages_builds_every_stages_groups(
    fake_dist: FakeDist, caplog: pytest.LogCaptureFixture
) -> None:
    import datetime

    from radixserve.core.distributed import Rendezvous, join

    config = _engine_config(tp_size=2, pp_size=3)
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="radixserve.core.distributed"):
        ranks = join(Platform(Closable()), config, Rendezvous("file:///x", 3, 6))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "engine rank 3 of 6: pipeline stage 1 of 3, tensor-parallel rank 1 of 2"
    ]
    assert ranks._threads_before == threads
    groups = [c[1:] for c in fake_dist.calls if c[0] == "new_group"]
    day30 = datetime.timedelta(days=30)
    assert groups == [
        (None, "gloo", day30),
        ([0, 1], None, None),
        ([0, 1], "gloo", day30),
        ([2, 3], None, None),
        ([2, 3], "gloo", day30),
        ([4, 5], None, None),
        ([4, 5], "gloo", day30),
    ]
    assert ranks.pp_size == 3 and ranks.size == 6
    assert (ranks.world.rank, ranks.world.size, ranks.world.group) == (3, 6, "world")
    assert ranks.world.cpu_group == "group2"
    group = ranks.group
    assert (group.rank, group.size, group.group, group.cpu_group) == (1, 2, "group5", "group6")
    assert group.fast_all_reduce is None  # none within a stage yet
    assert not any(c[0] == "all_reduce" for c in fake_dist.calls)


def test_two_pipeline_stages_are_stages_too(fake_dist: FakeDist) -> None:
    from radixserve.core.distributed import Rendezvous, join, stage_groups

    ranks = join(Platform(), _engine_config(pp_size=2), Rendezvous("file:///x", 1, 2))  # type: ignore[arg-type]
    assert ranks.pp_size == 2 and ranks.group.size == 1 and ranks.world.size == 2
    assert ranks.group.cpu_group == "group6"  # stage 1's own groups, not the world's
    with pytest.raises(AssertionError):
        stage_groups(4, 2, 2)  # a rank in no stage


def test_a_platform_that_cannot_build_its_fast_all_reduce_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from radixserve.core.distributed import _agreed_fast_all_reduce

    class Failing(Platform):
        def fast_all_reduce(self, group: Any, size: int) -> Any:
            self.calls.append(("fast_all_reduce", group, size))
            raise RuntimeError("no peer access")

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, op=None, group=None: None)
    platform = Failing()
    with caplog.at_level(logging.WARNING, logger="radixserve.core.distributed"):
        assert _agreed_fast_all_reduce(platform, "g", 4, "cpu", True) is None
    assert platform.calls == [("fast_all_reduce", "g", 4)]
    assert [r.getMessage() for r in caplog.records] == [
        "custom all-reduce unavailable, gloo's is used: no peer access"
    ]
