"""What the plugin contracts (core/interfaces*.py) do for a plugin that implements only the
abstract methods: every optional hook's default, the default step executor, the bitmask
format's three operations, a draft's shape and the step capabilities read from an executor.
Plugins rely on these defaults (a hook left out must change nothing), so each is pinned here
on a minimal subclass, without an engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from allow_all_grammar import AllowAllGrammar

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.interfaces import (
    Draft,
    Grammar,
    GrammarBackend,
    HardwarePlatform,
    KVConnector,
    SpeculativeAlgorithm,
    StepCapabilities,
    StepStrategy,
    TransferEvent,
)


class Toy(HardwarePlatform):
    name = "toy"
    device = "cpu"

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def default_plugins(self) -> dict[str, str]:
        return {}

    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        return 0


def test_a_platforms_optional_hooks_change_nothing() -> None:
    toy = Toy()
    assert toy.engine_defaults(None, 0) == {}  # type: ignore[arg-type]
    assert toy.asynchronous is False and toy.max_kv_tokens is None
    assert toy.distributed_backend() == "gloo"
    assert toy.fast_all_reduce("group", 2) is None
    config = EngineConfig()
    assert toy.resolve_config(config, "/model") is config
    ids = torch.tensor([3, 1, 2])
    wait = toy.copy_to_host_async(ids)
    assert wait() == [3, 1, 2] and type(wait()[0]) is int
    for hook in (toy.synchronize, toy.empty_cache, toy.bind_server_engine, toy.release):
        assert hook() is None
    assert toy.seed_everything(1) is None and toy.bind_rank(0, 2) is None


def test_the_default_platform_refuses_quantization_and_torch_compile() -> None:
    with pytest.raises(ConfigError) as e:
        Toy().quantize_model(None, "fp8")  # type: ignore[arg-type]
    assert str(e.value) == "--quantization fp8 is not supported on the toy platform"
    with pytest.raises(ConfigError) as e:
        Toy().step_executor(None, None, None, None, EngineConfig(enable_torch_compile=True))  # type: ignore[arg-type]
    assert str(e.value) == (
        "--enable-torch-compile is not supported on the toy platform (it compiles CPU decode "
        "steps; GPUs replay CUDA graphs instead)"
    )


def test_the_default_step_prepares_attention_then_runs_the_model() -> None:
    calls: list[tuple[str, Any]] = []
    attention = SimpleNamespace(prepare=lambda b: calls.append(("prepare", b)))
    model = SimpleNamespace(forward=lambda b: calls.append(("forward", b)) or "logits")
    run = Toy().step_executor(model, attention, None, None, EngineConfig())  # type: ignore[arg-type]
    assert calls == []  # built, not run
    assert run("batch") == "logits"  # type: ignore[arg-type]
    assert calls == [("prepare", "batch"), ("forward", "batch")]


class Matcher(AllowAllGrammar):
    """Allows the tokens in ``allowed`` (bitmask row ``index``)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = 0
        for t in self.allowed:
            word = bitmask[index, t // 32].item()
            value = (word | (1 << (t % 32))) & 0xFFFFFFFF
            bitmask[index, t // 32] = value - (1 << 32) if value >= 1 << 31 else value

    def copy(self) -> Grammar:
        return Matcher(self.allowed)


class Backend(GrammarBackend):
    def compile(self, kind: str, spec: str) -> Grammar:
        return Matcher([])


def test_a_grammars_size_and_shortest_output_default_to_zero() -> None:
    assert Matcher([1]).memory_bytes() == 0 and Matcher([1]).min_output_tokens() == 0


@pytest.mark.parametrize(("vocab", "words"), [(1, 1), (32, 1), (33, 2), (64, 2), (65, 3)])
def test_a_new_bitmask_allows_every_token(vocab: int, words: int) -> None:
    mask = Backend().allocate_bitmask(3, vocab)
    assert mask.dtype == torch.int32 and mask.shape == (3, words)
    assert (mask == -1).all() and mask.device.type == "cpu"


def test_bitmasks_mask_exactly_the_banned_tokens_of_the_given_rows() -> None:
    backend = Backend()
    vocab = 40
    mask = backend.allocate_bitmask(3, vocab)
    allowed = {0: [0, 5, 31, 39], 2: [1, 32]}
    backend.fill_bitmasks([(0, Matcher(allowed[0])), (2, Matcher(allowed[2]))], mask)
    assert (mask[1] == -1).all()  # a row no grammar filled: untouched
    logits = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    before = logits.clone()
    backend.apply_bitmask(logits, mask, [0, 2])
    for row in (0, 2):
        kept = [t for t in range(vocab) if logits[row, t] != float("-inf")]
        assert kept == allowed[row]
        assert torch.equal(logits[row, kept], before[row, kept])
    assert torch.equal(logits[1], before[1])  # a row not listed: unmasked
    # one row alone, listed by a higher index only
    logits = before.clone()
    backend.apply_bitmask(logits, mask, [2])
    assert torch.equal(logits[:2], before[:2])
    assert [t for t in range(vocab) if logits[2, t] != float("-inf")] == allowed[2]


def test_a_strategys_hooks_default_to_doing_nothing() -> None:
    s = StepStrategy()
    req = SimpleNamespace(rid="a")
    assert s.prepare(req) is None
    assert s.admit(req, False) is False and s.admit(req, True) is False
    assert s.admit_compiled(req) is None and s.admissible(req) is True
    assert s.refused(req, "x") is None and s.cancel_room(1, "x", None) is None
    assert s.ended_unscheduled([req]) is None and s.ended([req]) is None
    assert s.poll() == [] and s.abort("a", "x") is None
    assert s.has_work() is False and s.wait_timeout() is None
    assert s.drain(None) == [] and s.close() is None and s.spec_stats() is None
    assert s.needs_host_tokens(None) is False
    assert s.run_own_step(None, False) == ([], False)
    assert s.step_done(None, 0.0, False) is None
    assert s.extend_plan(None, [req]) == {}
    assert s.before_commit(None, req, Draft([1]), []) is None
    assert s.committed(None, []) is None and s.released(req) is None
    assert s.on_release(None, req) is None and s.pinned_tokens() == 0
    assert s.add_rows(None, 0, req, 1, Draft([1])) is False
    assert s.before_forward(None) is None and s.after_forward(None) is None  # type: ignore[arg-type]
    assert s.sample_rows(torch.zeros(1, 2), None, [], [0], None) is None


class Drafter(SpeculativeAlgorithm):
    def propose(self, reqs: Any, max_drafts: Any) -> list[Draft]:
        return [Draft([]) for _ in reqs]


def test_a_speculative_algorithms_optional_parts() -> None:
    d = Drafter()
    assert d.memory_needs(EngineConfig(), None, torch.float32) == (0, 0)
    assert d.drafts_trees is False and d.capture_hidden_layers == ()
    with pytest.raises(NotImplementedError):
        d.propose_trees([], [], [])
    assert d.device_cycle(None, 4) is None  # type: ignore[arg-type]
    assert d.setup(None) is None and d.verified([], []) is None and d.release("a") is None  # type: ignore[arg-type]


def test_a_draft_is_a_chain_unless_it_has_parents() -> None:
    assert Draft([4, 5]).decode_rows is False
    assert Draft([4, 5], parents=[-1, 0]).decode_rows is True
    assert Draft([], parents=[]).decode_rows is True  # an empty tree is still a tree


class Keeps:
    def keep_hidden_layers(self, layers: tuple[int, ...], consumer: Any = None) -> None:
        pass


def test_step_capabilities_read_from_the_executor() -> None:
    plain = StepCapabilities.of(lambda batch: None)
    assert plain == StepCapabilities(False, None)
    keeps = Keeps()
    caps = StepCapabilities.of(keeps)
    assert caps.keep_hidden_layers == keeps.keep_hidden_layers and caps.uniform_rows is False
    uniform = SimpleNamespace(uniform_verify=1)
    assert StepCapabilities.of(uniform).uniform_rows is True  # a bool, whatever was set
    assert StepCapabilities.of(SimpleNamespace(uniform_verify=False)).uniform_rows is False


class Wire(KVConnector):
    def start(self, role: str, kv_pool: Any, bootstrap_port: int, timeout: float) -> None: ...

    def send(self, room: int, kv_slots: torch.Tensor, meta: bytes) -> None: ...

    def receive(self, room: int, peer: tuple[str, int], kv_slots: torch.Tensor) -> None: ...

    def cancel(self, room: int, reason: str, refused: bool = False) -> None: ...

    def poll(self) -> list[TransferEvent]:
        return []


def test_a_kv_connectors_optional_parts() -> None:
    w = Wire()
    assert w.refused(3) is None and w.refuse(3, ("h", 1), "x") is None and w.close() is None
    assert w.wakeup_fd is None and w.bootstrap_host == ""
    event = TransferEvent(3, True)
    assert (event.meta, event.error, event.refused) == (b"", "", False)


def test_bitmasks_apply_on_the_logits_device() -> None:
    """The masking's own tensors are made on the logits' device: the meta device stands for an
    accelerator here (a host tensor mixed in fails there as it would on CUDA)."""
    logits = torch.zeros(3, 40, device="meta")
    mask = torch.full((3, 2), -1, dtype=torch.int32, device="meta")
    Backend().apply_bitmask(logits, mask, [0, 2])
    assert logits.device.type == "meta" and logits.shape == (3, 40)
