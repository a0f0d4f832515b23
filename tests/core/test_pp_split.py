"""Pipeline parallelism's pure parts: how the layers split into stages, how a step splits into
micro-batches of disjoint requests (rows, tokens, decodes and logits rows each land in their
micro-batch, in the step's order), the settings refused with it, and how a dead stage is
named."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.parallel import SINGLE, Span, TensorParallel, local_model_config
from radixserve.core.parallel import pipeline_stage as stage_of
from radixserve.core.pp_step import split_batch
from radixserve.entrypoints.tp_workers import rank_label


def test_layers_split_into_contiguous_stages_the_larger_last() -> None:
    stages = [stage_of(5, r, 2) for r in range(2)]
    assert [s.layers for s in stages] == [Span(0, 2), Span(2, 3)]
    assert stages[0].first and not stages[0].last and stages[1].last
    four = [stage_of(10, r, 4).layers for r in range(4)]
    assert [s.size for s in four] == [2, 3, 2, 3] and four[-1].stop == 10
    assert all(a.stop == b.start for a, b in zip(four, four[1:], strict=False))
    with pytest.raises(ConfigError, match="at least one decoder layer per stage"):
        stage_of(2, 0, 3)


def test_a_stage_config_counts_only_its_layers() -> None:
    from radixserve.core.config import ModelConfig

    mc = ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=64, num_layers=5, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=100, max_context=64, eos_token_ids=(0,),
        bos_token_id=None, raw={},
    )  # fmt: skip
    group = TensorParallel(stage=stage_of(5, 1, 2))
    assert local_model_config(mc, group).num_layers == 3
    assert local_model_config(mc, SINGLE).num_layers == 5


def _batch(extend: list[int], num_decode: int, logits_rows: list[int]) -> ForwardBatch:
    t = sum(extend)
    return ForwardBatch(
        input_ids=torch.arange(100, 100 + t),
        positions=torch.arange(t),
        out_cache_loc=torch.arange(200, 200 + t),
        req_pool_indices=torch.arange(len(extend)) + 10,
        req_to_token=torch.zeros(1, 1, dtype=torch.int64),
        seq_lens=[n + 5 for n in extend],
        extend_lens=extend,
        num_decode=num_decode,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        kv_pool=None,  # type: ignore[arg-type]
        req_to_token_pool=None,  # type: ignore[arg-type]
    )


def test_a_step_splits_into_micro_batches_of_disjoint_requests() -> None:
    # 3 decodes, then prefill chunks of 4 and 5 tokens (the last one's final token sampled)
    extend = [1, 1, 1, 4, 5]
    batch = _batch(extend, 3, [0, 1, 2, 11])
    parts = split_batch(batch, 2)
    assert len(parts) == 2
    (a, na), (b, nb) = parts
    assert a.extend_lens + b.extend_lens == extend  # every request once, in order
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), batch.input_ids)
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), batch.out_cache_loc)
    assert torch.equal(torch.cat([a.positions, b.positions]), batch.positions)
    assert torch.equal(torch.cat([a.req_pool_indices, b.req_pool_indices]), batch.req_pool_indices)
    assert a.seq_lens + b.seq_lens == batch.seq_lens
    assert a.num_decode + b.num_decode == 3
    assert a.num_decode == len([n for n in a.extend_lens if n == 1])
    # as even in tokens as whole requests allow: 1+1+1+4 | 5
    assert (a.num_tokens, b.num_tokens) == (7, 5)
    # each part's logits rows are its own tokens', counted from its first token
    assert (na, nb) == (3, 1) and a.logits_indices.tolist() == [0, 1, 2]
    assert b.logits_indices.tolist() == [4]  # the step's row 11, the 5th token of part b


def test_a_decode_batch_splits_evenly_and_never_into_empty_parts() -> None:
    parts = split_batch(_batch([1] * 7, 7, list(range(7))), 4)
    assert [p.batch_size for p, _ in parts] == [2, 2, 2, 1]
    assert [n for _, n in parts] == [2, 2, 2, 1]
    one = split_batch(_batch([1], 1, [0]), 4)
    assert len(one) == 1 and one[0][0].batch_size == 1
    # logits rows out of token order: the step stays whole rather than be reordered
    whole = split_batch(_batch([1, 1], 2, [1, 0]), 2)
    assert len(whole) == 1 and whole[0][1] == 2
    # one part asked for: the step itself; a repeated logits row is still in order
    step = _batch([2, 2], 0, [1, 3])
    assert [(p is step, n) for p, n in split_batch(step, 1)] == [(True, 2)]
    halves = split_batch(step, 2)  # 2 | 2: exactly half the tokens closes the first part
    assert [(p.extend_lens, n) for p, n in halves] == [([2], 1), ([2], 1)]
    repeated = split_batch(_batch([1, 1], 2, [0, 0, 1]), 2)
    assert [n for _, n in repeated] == [2, 1]


@pytest.mark.parametrize(
    ("settings", "what"),
    [
        ({"speculative_algorithm": "ngram"}, "speculative decoding"),
        ({"disaggregation_mode": "prefill"}, "disaggregation_mode=prefill"),
        ({"quantization": "int8wo"}, "--quantization int8wo"),
        ({"enable_torch_compile": True}, "--enable-torch-compile"),
    ],
)
def test_settings_pipeline_stages_do_not_run_with_are_refused(
    settings: dict[str, object], what: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{what} does not run with pp_size=2 yet$"):
        EngineConfig(pp_size=2, **settings)  # type: ignore[arg-type]
    EngineConfig(pp_size=1, **settings)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pp_size must be >= 1"):
        EngineConfig(pp_size=0)


def test_a_rank_is_named_by_its_stage_and_tensor_parallel_rank() -> None:
    assert rank_label(1, 2, 1) == "tensor-parallel rank 1"
    assert rank_label(3, 4, 2) == "engine rank 3 (pipeline stage 1, tensor-parallel rank 1)"
    assert rank_label(1, 2, 2) == "engine rank 1 (pipeline stage 1, tensor-parallel rank 0)"


# ---- the stages' step (PipelineStep), over a fake point-to-point network of threads ---------


class Net:
    """isend/recv between ranks, each rank a thread (its rank thread-local); every send is
    logged (src, dst, shape, dtype) and each receive checks it gets the shape and dtype sent."""

    def __init__(self) -> None:
        import queue
        import threading

        self.queues: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.me = threading.local()
        self.sent: list[tuple[int, int, tuple[int, ...], torch.dtype]] = []
        self.waited = 0

    def _queue(self, src: int, dst: int) -> Any:
        import queue

        with self.lock:
            return self.queues.setdefault((src, dst), queue.Queue())

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        assert t.is_contiguous()
        with self.lock:
            self.sent.append((self.me.rank, dst, tuple(t.shape), t.dtype))
        self._queue(self.me.rank, dst).put(t.clone())
        net = self

        class Work:
            def wait(self) -> None:
                with net.lock:
                    net.waited += 1

        return Work()

    def recv(self, x: torch.Tensor, src: int) -> None:
        got = self._queue(src, self.me.rank).get(timeout=5)
        assert (got.shape, got.dtype) == (x.shape, x.dtype)
        x.copy_(got)


HIDDEN, VOCAB = 3, 5


class Layers:
    """A stage's layers on a clock of its own: the first stage embeds each token id into a row
    of HIDDEN copies, the last one adds 1 to those rows and gives the logits rows (the row
    repeated to VOCAB wide); each token takes one tick of the stage's clock."""

    def __init__(self, stage: int, clock: list[float]) -> None:
        self.stage, self.clock, self.parts = stage, clock, []  # type: ignore[var-annotated]

    def __call__(self, part: ForwardBatch) -> torch.Tensor:
        self.parts.append(part)
        self.clock[0] += part.num_tokens
        if self.stage == 0:
            assert part.stage_input is None
            return part.input_ids.double()[:, None].expand(-1, HIDDEN)  # not contiguous
        assert part.stage_input is not None
        rows = part.stage_input[part.logits_indices] + 1
        return rows[:, :1].float().expand(-1, VOCAB)


def _pipeline(monkeypatch: pytest.MonkeyPatch, steps: list[ForwardBatch]) -> tuple[Any, ...]:
    """Run ``steps`` on a 2-stage pipeline of 2 tensor-parallel ranks each (ranks 0, 1: stage 0;
    2, 3: stage 1); returns (each rank's outputs, each rank's PipelineStep, the net)."""
    import threading

    from radixserve.core import pp_step
    from radixserve.core.pp_step import PipelineStep

    net = Net()
    monkeypatch.setattr(torch.distributed, "isend", net.isend)
    monkeypatch.setattr(torch.distributed, "recv", net.recv)
    clocks = threading.local()
    monkeypatch.setattr(pp_step, "time", SimpleNamespace(perf_counter=lambda: clocks.now[0]))
    mc = _mc()
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in range(4)}
    execs: dict[int, PipelineStep] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        net.me.rank = rank
        clocks.now = clock = [100.0 * rank]
        synced = [0]

        def synchronize() -> None:
            synced[0] += 1
            clock[0] += 0.5

        stage = stage_of(4, rank // 2, 2)
        step = PipelineStep(Layers(stage.rank, clock), stage, rank, 2, mc, torch.float64, "cpu",
                            synchronize if rank == 2 else None)  # fmt: skip
        execs[rank] = step
        try:
            for batch in steps:
                outs[rank].append(step(replace_batch(batch)))
                clock[0] += 1000.1  # the wait for rank 0 to schedule: not busy
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        step.synced = synced[0]  # type: ignore[attr-defined]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return outs, execs, net


def replace_batch(batch: ForwardBatch) -> ForwardBatch:
    from dataclasses import replace

    return replace(batch)  # each rank its own copy (stage_input is set on the parts)


def test_micro_batches_go_through_the_stages_and_the_logits_back_to_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixserve.core.pp_step import gather_stats, model_dtype

    # two micro-batches, the first without logits rows (a prefill chunk); then a step with none
    first = _batch([3, 3], 0, [5])
    none = _batch([2], 0, [])
    both = _batch([2, 2], 0, [1, 3])  # two micro-batches with a logits row each
    outs, execs, net = _pipeline(monkeypatch, [first, none, both])
    # rank 0 gets the last stage's logits rows: input id 105 (token 5), + 1, VOCAB wide
    logits, empty, two = outs[0]
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.full((1, VOCAB), 106.0))
    assert empty.shape == (0, VOCAB) and empty.dtype == torch.float32
    assert torch.equal(two, torch.tensor([[102.0] * VOCAB, [104.0] * VOCAB]))  # in order
    # the residual stream goes to the same tensor-parallel rank of the next stage; only the
    # last stage's rank 0 sends logits rows, for the micro-batch that has some
    assert sorted(net.sent) == sorted([
        (0, 2, (3, HIDDEN), torch.float64), (0, 2, (3, HIDDEN), torch.float64),
        (1, 3, (3, HIDDEN), torch.float64), (1, 3, (3, HIDDEN), torch.float64),
        (0, 2, (2, HIDDEN), torch.float64), (1, 3, (2, HIDDEN), torch.float64),
        (2, 0, (1, VOCAB), torch.float32),
    ] + [(0, 2, (2, HIDDEN), torch.float64), (1, 3, (2, HIDDEN), torch.float64),
         (2, 0, (1, VOCAB), torch.float32)] * 2)  # fmt: skip
    assert net.waited == len(net.sent)  # every send waited for before the step returns
    assert not any(q.qsize() for q in net.queues.values())
    # the other ranks return what their stage computed last
    assert outs[1][0].shape == (3, HIDDEN) and outs[3][0].shape == (1, VOCAB)
    assert [p.num_tokens for p in execs[2].run.parts] == [3, 3, 2, 2, 2]
    # busy: a tick per token (+ 0.5 a micro-batch where the device is waited for); wall: from
    # the first step's start to the last one's end, the wait between the steps included
    assert execs[2].synced == 5  # type: ignore[attr-defined]
    assert execs[2].stats() == pytest.approx({"stage": 1.0, "busy_s": 14.5, "wall_s": 2014.7})
    assert execs[1].stats() == pytest.approx({"stage": 0.0, "busy_s": 12.0, "wall_s": 2012.2})
    # a step that has run no step yet
    fresh = execs[1].__class__(execs[1].run, execs[1].stage, 1, 2, _mc(), torch.float64, "cpu")
    assert fresh.stats() == {"stage": 0.0, "busy_s": 0.0, "wall_s": 0.0}

    gathered: list[Any] = []

    def all_gather(out: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
        gathered.append(group)
        for i, o in enumerate(out):
            o.copy_(t * (i + 1))

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    world = TensorParallel(2, 2, cpu_group="gloo")
    # float64 on the wire: a float32 would round 2014.7 by ~1e-4
    assert gather_stats(world, execs[2]) == [
        pytest.approx({"stage": 1.0, "busy_s": 14.5, "wall_s": 2014.7}, rel=1e-12, abs=0),
        pytest.approx({"stage": 2.0, "busy_s": 29.0, "wall_s": 4029.4}, rel=1e-12, abs=0),
    ]
    assert gathered == ["gloo"]
    ints = torch.nn.Linear(1, 1).half()
    ints.register_parameter("ids", torch.nn.Parameter(torch.ones(1, dtype=torch.int64),
                                                      requires_grad=False))  # fmt: skip
    assert model_dtype(ints) == torch.float16
    assert model_dtype(torch.nn.Module()) == torch.float32


def _mc() -> Any:
    from radixserve.core.config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=HIDDEN, num_layers=4, num_heads=1,
        num_kv_heads=1, head_dim=HIDDEN, vocab_size=VOCAB, max_context=64, eos_token_ids=(0,),
        bos_token_id=None, raw={},
    )  # fmt: skip


@pytest.mark.parametrize("field", ["hidden_rows", "capture_hidden_layers"])
def test_pooled_hidden_states_are_refused_with_stages(field: str) -> None:
    from dataclasses import replace

    from radixserve.core.pp_step import PipelineStep

    step = PipelineStep(lambda b: b.input_ids, stage_of(4, 0, 2), 0, 1, _mc(), torch.float32,
                        "cpu")  # fmt: skip
    batch = replace(_batch([2], 0, [1]), **{field: torch.tensor([0]) if field == "hidden_rows"
                                            else (1,)})  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        step(batch)
    assert str(err.value) == "pooled hidden states (embeddings) are not served with pp_size=2"
