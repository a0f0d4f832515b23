"""ModelRunner on the tiny random Llama (CPU): the plugins and dtypes it resolves, the KV pool's
size on a platform that reports a fixed memory budget, the running limit fitted to that pool,
the model's choice and reloads, and its steps launched by hand from the scheduler's plans
(sampling paths, strategies that sample, input and label logprobs, pooled embeddings and the
grammar mask's logprobs checked against transformers' own forward)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.models.llama.modeling_llama  # noqa: F401 - see below
from allow_all_grammar import AllowAllGrammar
from platform_choice import on_cpu
from scheduler_checks import greedy, tokens
from tiny_models import make_tiny_llama_dir
from transformers import AutoModelForCausalLM

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import PLUGIN_KINDS, Grammar, GrammarBackend, StepStrategy
from radixserve.core.memory import KVPool
from radixserve.core.model_runner import ModelRunner
from radixserve.core.plugins import PluginError, PluginHost
from radixserve.core.request import Req, SamplingParams
from radixserve.core.weights import count_parameters
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.models.llama import LlamaForCausalLM

PER_TOKEN = KVPool.bytes_per_token(2, 2, 16, torch.float32)  # the tiny Llama's KV, float32

# transformers' Llama (the tiny model's builder and the reference forward use it) is imported
# at collection, not at first use: mutmut's fork server (tests/support/mutation.py) then loads
# it once, not once per mutant (~6 s each on the shared VM).


class Sized:
    """Registers hardware ``sized_cpu``: the CPU with room for ``tokens`` KV tokens (of the
    tiny Llama in float32) whatever the weights, recording what the runner asks of it."""

    def __init__(self, tokens: int, max_kv_tokens: int | None = None) -> None:
        self.tokens, self.max_kv_tokens = tokens, max_kv_tokens
        self.asked: list[tuple[int, float]] = []
        self.quantized: list[tuple[Any, str]] = []
        self.prepared: list[tuple[Any, EngineConfig]] = []

    @hookimpl
    def register_hardware_platforms(self, register: Any) -> None:
        plugin = self

        class SizedCpu(CpuPlatform):
            name = "sized_cpu"
            max_kv_tokens = plugin.max_kv_tokens

            def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
                plugin.asked.append((weight_bytes, mem_fraction))
                return plugin.tokens * PER_TOKEN + PER_TOKEN - 1

            def quantize_model(self, model: Any, method: str) -> None:
                plugin.quantized.append((model, method))

            def prepare_model(self, model: Any, config: EngineConfig) -> None:
                plugin.prepared.append((model, config))

        register("sized_cpu", SizedCpu, description="test: a fixed KV budget", priority=-1)


def runner_of(model_dir: Path, *plugins: object, **settings: Any) -> ModelRunner:
    host = PluginHost(extra_plugins=[(f"test{i}", p) for i, p in enumerate(plugins)])
    return ModelRunner(model_dir, EngineConfig(**on_cpu(settings)), host)


def sized(model_dir: Path, plugin: Sized, **settings: Any) -> ModelRunner:
    settings["plugins"] = ("hardware=sized_cpu",)
    return runner_of(model_dir, plugin, **settings)


def core_of(model_dir: Path, *plugins: object, **settings: Any) -> EngineCore:
    settings.setdefault("max_total_tokens", 256)
    host = PluginHost(extra_plugins=[(f"test{i}", p) for i, p in enumerate(plugins)])
    return EngineCore(model_dir, EngineConfig(**on_cpu(settings)), host)


# -- what the runner resolves ----------------------------------------------------------------


def test_every_plugin_kind_is_chosen_and_named(tiny_llama_dir: Path) -> None:
    runner = runner_of(tiny_llama_dir, max_total_tokens=64, plugins=("attention=torch_native",))
    names = runner.plugins.names
    kinds = ["hardware", *(k for k in PLUGIN_KINDS if k not in ("hardware", "model")), "model"]
    assert list(names) == kinds
    assert names["hardware"] == "cpu" and names["attention"] == "torch_native"
    assert names["model"] == "LlamaForCausalLM"
    assert str(runner.plugins) == " ".join(f"{k}={v}" for k, v in names.items())


def test_dtypes_auto_and_chosen(tiny_llama_dir: Path) -> None:
    auto = runner_of(tiny_llama_dir, max_total_tokens=64)
    assert (auto.dtype, auto.kv_dtype) == (torch.float32, torch.float32)
    assert auto.kv_pool.k[0].dtype == torch.float32
    bf16 = runner_of(tiny_llama_dir, max_total_tokens=64, dtype="bfloat16")
    assert (bf16.dtype, bf16.kv_dtype) == (torch.bfloat16, torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    fp16_kv = runner_of(
        tiny_llama_dir, max_total_tokens=64, kv_cache_dtype="float16",
        plugins=("attention=torch_native",),
    )  # fmt: skip
    assert (fp16_kv.dtype, fp16_kv.kv_dtype) == (torch.float32, torch.float16)
    assert fp16_kv.kv_pool.k[0].dtype == torch.float16


class Narrow:
    """Registers attention ``narrow``: torch_native reading KV only in the model's dtype."""

    @hookimpl
    def register_attention_backends(self, register: Any) -> None:
        class NarrowAttention(TorchNativeAttention):
            reads_other_kv_dtype = False

        register("narrow", NarrowAttention, description="test: KV in the model's dtype only")


def test_a_kv_dtype_the_attention_backend_cannot_read_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError) as e:
        runner_of(
            tiny_llama_dir, Narrow(), max_total_tokens=64, kv_cache_dtype="float16",
            plugins=("attention=narrow",),
        )  # fmt: skip
    assert str(e.value) == (
        "--kv-cache-dtype float16: the narrow attention backend reads KV only in the "
        "model's dtype (float32); choose --kv-cache-dtype auto, or the torch_native or "
        "cpu_paged backend (fp8_e4m3: the triton or torch_native backend)"
    )
    same = runner_of(tiny_llama_dir, Narrow(), max_total_tokens=64, plugins=("attention=narrow",))
    assert same.kv_dtype == torch.float32


def test_the_context_and_the_slot_tables_sizes(tiny_llama_dir: Path) -> None:
    runner = runner_of(tiny_llama_dir, max_total_tokens=64, context_length=100)
    assert runner.max_context == 100 == runner.config.context_length
    rows = runner.settings.max_running_requests + 1 + runner.reservation.table_rows
    assert tuple(runner.req_to_token.table.shape) == (rows, 101)
    assert runner_of(tiny_llama_dir, max_total_tokens=64).max_context == 512
    assert runner_of(tiny_llama_dir, max_total_tokens=64, context_length=4096).max_context == 512
    pool = runner.kv_pool
    assert (len(pool.k), tuple(pool.k[0].shape[-2:])) == (2, (2, 16))
    assert runner.allocator.size == runner.kv_size == 64


# -- the KV pool's size and the running limit ------------------------------------------------


def test_the_pool_holds_what_the_platforms_budget_allows(tiny_llama_dir: Path) -> None:
    plugin = Sized(3000)
    runner = sized(tiny_llama_dir, plugin, mem_fraction_static=0.5)
    assert runner.kv_size == 3000 == runner.allocator.size
    weights = count_parameters(tiny_llama_dir) * 4
    assert plugin.asked == [(weights, 0.5)]
    assert runner.settings.mem_fraction_static == 0.5
    capped = sized(tiny_llama_dir, Sized(3000, max_kv_tokens=2000))
    assert capped.kv_size == 2000
    assert sized(tiny_llama_dir, Sized(3000, max_kv_tokens=5000)).kv_size == 3000
    told = Sized(3000)
    assert sized(tiny_llama_dir, told, max_total_tokens=100).kv_size == 100
    assert told.asked == []  # a set size is not asked for


def test_a_pool_under_16_tokens_is_refused(tiny_llama_dir: Path) -> None:
    assert sized(tiny_llama_dir, Sized(16)).kv_size == 16
    with pytest.raises(ConfigError) as e:
        sized(tiny_llama_dir, Sized(15), mem_fraction_static=0.5)
    assert str(e.value) == (
        "no memory left for the KV pool with mem_fraction_static=0.5 (flag); raise it or set "
        "max_total_tokens"
    )


def test_a_default_running_limit_is_fitted_to_the_pool(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    default = 64  # the CPU's default max_running_requests
    with caplog.at_level("WARNING", logger="radixserve.core.model_runner"):
        runner = sized(tiny_llama_dir, Sized(1000))
    assert runner.settings.max_running_requests == 7 == runner.config.max_running_requests
    why = f"lowered from {default}: the KV pool holds 1000 tokens, 128 per running request"
    assert runner.settings.origins["max_running_requests"] == why
    assert [r.getMessage() for r in caplog.records] == [f"max_running_requests 7: {why}"]
    assert tuple(runner.req_to_token.table.shape)[0] == 7 + 1 + runner.reservation.table_rows
    assert sized(tiny_llama_dir, Sized(20)).settings.max_running_requests == 1
    full = sized(tiny_llama_dir, Sized(default * 128))  # holds exactly the default
    assert full.settings.max_running_requests == default
    assert full.settings.origins["max_running_requests"] == "default"
    assert full.settings.origins["prefill_shrink_after_decodes"] == "sized_cpu default"
    flag = sized(tiny_llama_dir, Sized(1000), max_running_requests=20)
    assert flag.settings.max_running_requests == 20 == flag.config.max_running_requests
    assert sized(tiny_llama_dir, Sized(1000), max_total_tokens=1000).config.max_running_requests
    assert (
        sized(tiny_llama_dir, Sized(0), max_total_tokens=1000).settings.max_running_requests
        == default
    )


# -- the model -------------------------------------------------------------------------------


def _with_architecture(model_dir: Path, out: Path, arch: str) -> Path:
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [arch]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_model_without_a_plugin_is_refused_by_its_architecture(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    other = _with_architecture(tiny_llama_dir, tmp_path / "m", "NopeForCausalLM")
    with pytest.raises(PluginError) as e:
        runner_of(other, max_total_tokens=64)
    names = PluginHost().registries["model"].available_names()
    assert "LlamaForCausalLM" in names
    assert str(e.value) == (
        f"no model plugin for architecture 'NopeForCausalLM'; available: {', '.join(names)}"
    )
    with pytest.raises(PluginError) as asked:
        runner_of(tiny_llama_dir, max_total_tokens=64, plugins=("model=nope",))
    assert "no model plugin for architecture" not in str(asked.value)
    assert "nope" in str(asked.value)


def test_quantization_at_load_and_no_reload_of_a_quantized_model(tiny_llama_dir: Path) -> None:
    plugin = Sized(1000)
    runner = sized(tiny_llama_dir, plugin, max_total_tokens=64, quantization="int8wo")
    assert plugin.quantized == [(runner.model, "int8wo")]
    assert plugin.prepared == [(runner.model, runner.config)]
    with pytest.raises(ConfigError) as e:
        runner.reload_weights(tiny_llama_dir)
    assert str(e.value) == (
        "loading new weights into a model quantized at load (quantization=int8wo) is not "
        "supported; restart instead"
    )
    assert sized(tiny_llama_dir, plugin, max_total_tokens=64).config.quantization is None
    assert len(plugin.quantized) == 1


def test_reload_weights_replaces_them_in_place(tiny_llama_dir: Path, tmp_path: Path) -> None:
    runner = runner_of(tiny_llama_dir, max_total_tokens=64)
    param = next(runner.model.parameters())
    before = param.detach().clone()
    runner.reload_weights(make_tiny_llama_dir(tmp_path / "other", seed=3))
    assert next(runner.model.parameters()) is param and not torch.equal(param, before)
    wrong = make_tiny_llama_dir(tmp_path / "wide", seed=3, hidden_size=32)
    with pytest.raises((ConfigError, ValueError)):
        runner.reload_weights(wrong)


# -- steps launched by hand ------------------------------------------------------------------


def plan_of(core: EngineCore, *reqs: Req) -> Any:
    for req in reqs:
        core.add_request(req)
    plan = core.scheduler.schedule()
    assert plan is not None and plan.reqs == list(reqs)
    return plan


def test_a_step_without_rows_to_sample_returns_nothing(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    plan = plan_of(core, Req("a", tokens(1, 5), greedy(2)))
    launched = core.runner.launch(plan, [], core.eos_token_ids)
    assert launched.next_ids is None and launched.overlappable and launched.result() == {}


def test_overlappable_rows_are_sampled_on_the_device(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    a, b = Req("a", tokens(1, 5), greedy(2)), Req("b", tokens(2, 3), greedy(2))
    plan = plan_of(core, a, b)
    launched = core.runner.launch(plan, [0, 1], core.eos_token_ids)
    assert launched.overlappable and launched.next_ids is not None
    result = launched.result()
    assert list(result) == [0, 1] and all(v[1:] == (None, None) for v in result.values())
    assert launched.next_ids.tolist() == [result[0][0], result[1][0]]
    only_b = core.runner.launch(plan, [1], core.eos_token_ids).result()
    assert only_b == {1: result[1]}
    assert core.runner.run(plan, [1], core.eos_token_ids) == only_b


def test_rows_with_logprobs_are_sampled_now(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=True, top_logprobs_num=2)
    a, b = Req("a", tokens(1, 5), params), Req("b", tokens(2, 3), greedy(2))
    plan = plan_of(core, a, b)
    plain = core.runner.launch(plan, [0, 1], core.eos_token_ids)
    plain_again = core.runner.launch(plan, [1], core.eos_token_ids)
    assert plain.overlappable is False and plain.next_ids is None
    result = plain.result()
    token, logprob, top = result[0]
    assert top[0][1] == token and top[0][0] == pytest.approx(logprob) and logprob < 0
    assert len(top) == 2
    # the sampler keeps logprobs for every row of a step that asked for some
    assert result[1][0] == plain_again.result()[1][0] and result[1][1] <= 0


def test_the_first_strategy_that_samples_a_step_wins(tiny_llama_dir: Path) -> None:
    asked: list[str] = []

    class Pass(StepStrategy):
        def sample_rows(self, logits: Any, batch: Any, plans: Any, rows: Any, eos: Any) -> Any:
            asked.append("pass")
            return None

    class Take(StepStrategy):
        def sample_rows(self, logits: Any, batch: Any, plans: Any, rows: Any, eos: Any) -> Any:
            asked.append("take")
            assert logits.shape[0] == 1 and rows == [0] and eos == (0,)
            assert [p.sample_row for p in plans] == [0]
            return {0: (7, None, None)}

    class Never(StepStrategy):
        def sample_rows(self, logits: Any, batch: Any, plans: Any, rows: Any, eos: Any) -> Any:
            raise AssertionError("a step is sampled once")

    core = core_of(tiny_llama_dir)
    core.strategies.extend([Pass(), Take(), Never()])
    plan = plan_of(core, Req("a", tokens(1, 5), greedy(2)))
    launched = core.runner.launch(plan, [0], core.eos_token_ids)
    assert launched.result() == {0: (7, None, None)}
    assert launched.overlappable is False and launched.next_ids is None
    assert asked == ["pass", "take"]


# -- against transformers' forward -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run_all(core: EngineCore) -> None:
    for _ in range(100):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("no progress")


def test_input_and_label_logprobs_are_the_models(tiny_llama_dir: Path, hf: Any) -> None:
    core = core_of(tiny_llama_dir, chunked_prefill_size=4)
    ids = tokens(5, 9)
    scored = Req("scored", ids, greedy(1))
    scored.logprob_start_len = 0
    labels = Req("labels", tokens(6, 7), SamplingParams(max_new_tokens=0))
    labels.label_token_ids = [3, 9]
    core.add_request(scored)
    core.add_request(labels)
    run_all(core)
    ref = hf_logprobs(hf, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert scored.input_token_logprobs == pytest.approx(want, abs=1e-4)
    last = hf_logprobs(hf, labels.input_ids)[-1]
    assert labels.label_logprobs == pytest.approx([last[3].item(), last[9].item()], abs=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_embeddings_are_the_models_final_hidden_states(
    tiny_llama_dir: Path, hf: Any, pooling: str
) -> None:
    core = core_of(tiny_llama_dir, chunked_prefill_size=4)
    req = Req("e", tokens(7, 10), SamplingParams(max_new_tokens=0))
    req.pooling = pooling
    core.add_request(req)
    run_all(core)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([req.input_ids])).last_hidden_state[0]
    vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    assert req.embedding == pytest.approx((vec / vec.norm()).tolist(), abs=1e-4)


class NoHidden:
    """Registers model ``NoHiddenLlama``, which keeps no final hidden states."""

    @hookimpl
    def register_models(self, register: Any) -> None:
        class NoHiddenLlama(LlamaForCausalLM):
            def forward(self, batch: Any) -> Any:
                batch.hidden_rows = None
                return super().forward(batch)

        register("NoHiddenLlama", NoHiddenLlama, description="test: no final hidden states")


def test_embeddings_need_a_model_that_keeps_final_hidden_states(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir, NoHidden(), plugins=("model=NoHiddenLlama",))
    plan = plan_of(core, Req("e", tokens(7, 4), SamplingParams(max_new_tokens=0)))
    plan.reqs[0].pooling = "last"
    with pytest.raises(RuntimeError) as e:
        core.runner.launch(plan, [], core.eos_token_ids)
    assert str(e.value) == (
        "model plugin 'NoHiddenLlama' keeps no final hidden states (ForwardBatch.hidden_rows), "
        "so it cannot serve embeddings"
    )


class OneToken(AllowAllGrammar):
    """Allows only token ``ONLY``."""

    ONLY = 9

    def accept_token(self, token_id: int) -> bool:
        return token_id == self.ONLY

    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        bitmask[index].zero_()
        bitmask[index, self.ONLY // 32] = 1 << (self.ONLY % 32)

    def copy(self) -> Grammar:
        return OneToken()


class OneTokenPlugin:
    @hookimpl
    def register_grammar_backends(self, register: Any) -> None:
        class Backend(GrammarBackend):
            def compile(self, kind: str, spec: str) -> Grammar:
                return OneToken()

        register("one", lambda tokenizer, vocab, stops: Backend())


def test_logprobs_under_a_grammar_are_the_models_unmasked_ones(
    tiny_llama_dir: Path, hf: Any
) -> None:
    core = core_of(tiny_llama_dir, OneTokenPlugin(), grammar_backend="one")
    ids = tokens(8, 6)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=True, regex="x")
    masked = Req("m", ids, params)
    plain = Req("p", ids, greedy(1))  # no grammar, no logprobs, beside it
    core.add_request(masked)
    core.add_request(plain)
    run_all(core)
    ref = hf_logprobs(hf, ids)[-1]
    assert masked.output_ids == [OneToken.ONLY]
    assert masked.output_logprobs == pytest.approx([ref[OneToken.ONLY].item()], abs=1e-4)
    assert ref[OneToken.ONLY].item() < -1e-3  # the mask would have made it 0
    assert plain.output_ids == [int(ref.argmax())]


def test_a_strategy_adds_the_rows_of_an_entry_with_extra_rows(tiny_llama_dir: Path) -> None:
    calls: list[tuple[str, int, str, int, object]] = []

    class Rows(StepStrategy):
        def __init__(self, name: str, takes: bool) -> None:
            self.name, self.takes = name, takes

        def add_rows(self, rows: Any, index: int, req: Req, n: int, extra: Any) -> bool:
            calls.append((self.name, index, req.rid, n, extra))
            if self.takes:
                rows.add_extend(req, n)
            return self.takes

    core = core_of(tiny_llama_dir)
    core.strategies.extend([Rows("declines", False), Rows("takes", True), Rows("never", True)])
    plan = plan_of(core, Req("a", tokens(1, 5), greedy(2)), Req("b", tokens(2, 3), greedy(2)))
    plain, plain_plans = core.runner.build_batch(plan)
    assert calls == []  # no entry has extra rows
    extra = object()
    plan.extra[0] = extra  # the entries after it are built as usual
    fb, plans = core.runner.build_batch(plan)
    assert calls == [("declines", 0, "a", 5, extra), ("takes", 0, "a", 5, extra)]
    assert plans == plain_plans and torch.equal(fb.input_ids, plain.input_ids)


def test_only_plain_decodes_may_have_a_pending_token(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    plan = plan_of(core, Req("a", tokens(1, 5), greedy(2)))
    plan.reqs[0].num_pending = 1
    with pytest.raises(AssertionError, match="^only plain decodes have pending tokens$"):
        core.runner.build_batch(plan)


def test_the_stop_tokens_given_are_masked_before_min_new_tokens(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    for logprobs in (False, True):  # sampled on the device, or at once
        params = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=logprobs)
        plan = plan_of(core, Req(f"a{logprobs}", tokens(1, 5), params))
        [(token, *_)] = core.runner.run(plan, [0], ()).values()
        params.min_new_tokens = 1
        [(masked, *_)] = core.runner.run(plan, [0], (token,)).values()
        assert masked != token
        core.scheduler.abort(plan.reqs[0].rid, "done")


def test_a_runner_without_a_grammar_masker_samples_unmasked(tiny_llama_dir: Path) -> None:
    core = core_of(tiny_llama_dir)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=True)
    plan = plan_of(core, Req("a", tokens(1, 5), params))
    [(token, *_)] = core.runner.run(plan, [0], ()).values()
    assert token != OneToken.ONLY
    plan.reqs[0].grammar = OneToken()
    assert core.runner.run(plan, [0], ())[0][0] == OneToken.ONLY
    core.runner.grammar_masker = None  # a runner alone (EngineCore gives it one)
    assert core.runner.run(plan, [0], ())[0][0] == token


def test_strategies_see_the_steps_forward_batch_before_and_after_the_model(
    tiny_llama_dir: Path,
) -> None:
    seen: list[tuple[str, Any, int]] = []

    class Watch(StepStrategy):
        def before_forward(self, batch: Any) -> None:
            seen.append(("before", batch, len(batch.input_ids)))

        def after_forward(self, batch: Any) -> None:
            seen.append(("after", batch, len(batch.input_ids)))

    core = core_of(tiny_llama_dir)
    core.strategies.append(Watch())
    plan = plan_of(core, Req("a", tokens(1, 5), greedy(2)), Req("b", tokens(2, 3), greedy(2)))
    core.runner.run(plan, [0, 1], core.eos_token_ids)
    assert [(w, n) for w, _, n in seen] == [("before", 8), ("after", 8)]
    assert seen[0][1] is seen[1][1] and isinstance(seen[0][1], ForwardBatch)


class NotInvariant:
    """Registers attention ``plain`` and model ``PlainLlama``, neither with a batch-invariant
    mode."""

    @hookimpl
    def register_attention_backends(self, register: Any) -> None:
        class PlainAttention(TorchNativeAttention):
            set_batch_invariant = None  # type: ignore[assignment]

        register("plain", PlainAttention, description="test: no batch-invariant mode")

    @hookimpl
    def register_models(self, register: Any) -> None:
        class PlainLlama(LlamaForCausalLM):
            set_batch_invariant = None  # type: ignore[assignment]

        register("PlainLlama", PlainLlama, description="test: no batch-invariant mode")


@pytest.mark.parametrize(
    ("plugins", "what"),
    [
        (("attention=plain",), "the plain attention backend"),
        (("attention=torch_native", "model=PlainLlama"), "model plugin 'PlainLlama'"),
    ],
)
def test_deterministic_inference_needs_batch_invariant_parts(
    tiny_llama_dir: Path, plugins: tuple[str, ...], what: str
) -> None:
    settings: dict[str, Any] = {"max_total_tokens": 64, "plugins": plugins}
    assert runner_of(tiny_llama_dir, NotInvariant(), **settings).plugins
    with pytest.raises(ConfigError) as e:
        runner_of(tiny_llama_dir, NotInvariant(), enable_deterministic_inference=True, **settings)
    assert str(e.value).startswith(
        f"--enable-deterministic-inference: {what} has no batch-invariant mode"
    )


def test_pages_and_the_pools_compute_dtype(tiny_llama_dir: Path) -> None:
    runner = runner_of(
        tiny_llama_dir, max_total_tokens=64, page_size=4, kv_cache_dtype="float16",
        plugins=("attention=torch_native",),
    )  # fmt: skip
    assert runner.allocator.page_size == 4 == runner.kv_pool.page_size
    assert runner.kv_pool.compute_dtype == torch.float32
