"""The abstract contract of each plugin kind.

The core talks to plugins only through these bases. Each docstring states the rules an
implementation must keep. Torch appears here only as a tensor type; device-specific code lives in
the plugins.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.core.config import ConfigError

# what a step executor, a model or a module may also offer, declared once (re-exported)
from radixserve.core.interfaces_capabilities import (  # noqa: F401
    KeepsHiddenLayers,
    KeepsWeightCopies,
    ReleasesCapture,
    ShardedModel,
    StepCapabilities,
    UniformRows,
)

# the speculative and KV-transfer plugins' contracts live beside this file (re-exported)
from radixserve.core.interfaces_kv_transfer import KVConnector, TransferEvent  # noqa: F401
from radixserve.core.interfaces_speculative import (  # noqa: F401
    DeviceCycle,
    Draft,
    SpeculativeAlgorithm,
    SpeculativeContext,
    TargetVerify,
)

if TYPE_CHECKING:
    import torch

    from radixserve.core.batch import ForwardBatch
    from radixserve.core.config import EngineConfig, ModelConfig
    from radixserve.core.memory import KVPool, ReqToTokenPool

#: Runs one model step: ForwardBatch -> logits (see ``HardwarePlatform.step_executor``).
StepExecutor = Callable[["ForwardBatch"], "torch.Tensor"]

PLUGIN_KINDS = (
    "hardware", "attention", "model", "grammar", "speculative", "kv_transfer", "hicache_storage",
)  # fmt: skip


class HardwarePlatform(ABC):
    """A device family (cpu, cuda, rocm, ...). Chooses defaults for the other plugin kinds."""

    name: str
    #: torch device string, e.g. "cpu" or "cuda:0"
    device: str

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """Weights and KV dtype when the user does not choose one."""

    @abstractmethod
    def default_plugins(self) -> dict[str, str]:
        """Default implementation name per plugin kind (e.g. {"attention": "torch_native"})."""

    @abstractmethod
    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        """Bytes to give the KV pool after ``weight_bytes`` of weights are loaded."""

    #: Most tokens a KV pool sized from memory may hold (None: no cap).
    max_kv_tokens: int | None = None

    def engine_defaults(self, model: ModelConfig, weight_bytes: int) -> dict[str, Any]:
        """This device's defaults for any of the settings in ``core.config.CORE_DEFAULTS``
        (max_running_requests, mem_fraction_static, chunked_prefill_size, cuda_graph_max_bs,
        prefill_shrink_after_decodes).
        A flag the user gives wins; a setting left out here takes the core's default. The
        ready banner and /server_info show each value with where it came from."""
        return {}

    #: True where device work runs asynchronously to the host (CUDA): then the engine overlaps
    #: scheduling the next step with the device computing this one.
    asynchronous: bool = False

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def copy_to_host_async(self, tensor: torch.Tensor) -> Callable[[], list[int]]:
        """Start copying a small integer tensor (the sampled ids) to the host; the returned
        function waits for it and returns its values. Synchronous devices copy on the call."""
        return tensor.tolist

    def seed_everything(self, seed: int) -> None:
        """Seed the device's random generators."""

    def empty_cache(self) -> None:
        """Give cached, unused device memory back to the device, so that ``kv_cache_bytes``
        sees what a shut-down engine let go of. A no-op where nothing is cached (CPU)."""

    def distributed_backend(self) -> str:
        """The torch.distributed backend tensor parallelism uses between this platform's
        devices ("gloo" on the host; e.g. "nccl" on CUDA). Host-side step metadata always
        travels over a gloo group beside it."""
        return "gloo"

    def bind_rank(self, rank: int, size: int) -> None:  # noqa: B027 - optional hook
        """Tensor parallelism: this process is rank ``rank`` of the ``size`` ranks of its node
        (all of them on one node) and drives that rank's device (e.g. ``cuda:{rank}``); set
        ``device`` to it. Called once, before anything is
        allocated. The default does nothing (every rank uses ``device`` as it is)."""

    def fast_all_reduce(self, group: Any, size: int) -> Any:
        """Tensor parallelism: an all-reduce faster than the backend's for some messages (e.g.
        small ones, over NVLink peer-to-peer), or None (the default: the backend's for all).
        What it returns follows ``core.parallel.FastAllReduce``: called with a tensor, it
        sums it in place over ``group``'s ``size`` ranks and returns True, or returns False for
        a tensor it does not take; it may run inside CUDA-graph capture. Called once on every
        rank after the group is up (``--disable-custom-all-reduce`` skips it); when a rank
        fails to build one, no rank uses it."""
        return None

    def bind_server_engine(self) -> None:  # noqa: B027 - optional hook
        """This engine runs in its own process beside the HTTP server's process (which
        tokenizes, detokenizes and streams every token): take a share of the host that leaves
        that process room (e.g. fewer CPU threads). Called once in the server's engine process,
        after the engine is built; the offline Engine never calls it. Default: nothing."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """The engine shut down: undo what this platform changed for the whole process while
        the engine ran (an offline Engine's process goes on, e.g. with its own thread count).
        Default: nothing."""

    def resolve_config(self, config: EngineConfig, model_dir: str) -> EngineConfig:
        """``config`` with what the user left to this device chosen for the model in
        ``model_dir`` (e.g. the CPU's fast mode for a GGUF file: its block formats, a 16-bit
        KV cache, compiled decode steps). Called once, before anything is built; the engine
        runs with what it returns. Default: the config as given."""
        return config

    def prepare_model(self, model: CausalLM, config: EngineConfig) -> None:  # noqa: B027
        """Ready the loaded (and quantized) ``model`` for this device's kernels, e.g. repack
        its weights. Called once, after the weights are loaded. A module that keeps a copy
        of its weights defines ``weights_reloaded()``, which a weight reload calls (it must
        not change the parameters themselves). Default: nothing."""

    def prepare_draft_head(self, head: torch.nn.Module, config: EngineConfig) -> None:  # noqa: B027
        """Ready a speculative drafter's own module (an EAGLE, EAGLE-3 or DFlash head, after
        its weights are loaded) for this device's kernels, as ``prepare_model`` the target's.
        Default: nothing."""

    def quantize_model(self, model: CausalLM, method: str) -> None:
        """Quantize the loaded ``model``'s weights in place (``--quantization``, one of
        ``core.config.QUANTIZATIONS``) with this device's kernels. Called once, after the
        weights are loaded. The default refuses every method."""
        raise ConfigError(f"--quantization {method} is not supported on the {self.name} platform")

    def step_executor(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        config: EngineConfig,
    ) -> StepExecutor:
        """How each step runs the model, built once after the weights are loaded.

        ``req_to_token`` owns the slot table; device code reads it through
        ``req_to_token.device_table(device)``, which is current whenever a step starts.

        The default prepares attention and calls ``model.forward``. A platform may return a
        faster executor for some batches (e.g. replay captured CUDA graphs for decode-only
        batches); it must give the same logits and leave the KV pool as the default would.
        An executor whose verify steps are much faster when every request verifies as many
        tokens (captured graphs) sets ``uniform_verify = True``: the scheduler then pads
        token-only drafts to one length.
        """

        if config.enable_torch_compile:
            raise ConfigError(
                f"--enable-torch-compile is not supported on the {self.name} platform "
                "(it compiles CPU decode steps; GPUs replay CUDA graphs instead)"
            )

        def run(batch: ForwardBatch) -> torch.Tensor:
            attention.prepare(batch)
            return model.forward(batch)

        return run


class AttentionBackend(ABC):
    """Paged attention over the shared KV pool.

    Rules: ``prepare`` runs once per step before the model and may build index tensors that all
    layers reuse; ``forward`` first writes the new tokens' K/V into the pool at
    ``batch.out_cache_loc`` and then attends, causally, each new token to its request's cached
    prefix and to the new tokens before it (and itself).

    The slot table: read a request's KV slots from ``batch.req_to_token`` (host) or
    ``batch.req_to_token_pool.device_table(device)`` (a device mirror the pool keeps current).
    Never keep a private copy of rows across steps: the scheduler rewrites rows when prefixes
    are shared, requests are retracted or slots are reused, and a copy would go stale.
    """

    #: whether the backend attends a pool whose dtype differs from the queries'
    #: (``kv_pool.compute_dtype``), as --kv-cache-dtype asks: the engine refuses it otherwise
    reads_other_kv_dtype: bool = False
    #: Capabilities, declared (the core never probes): ``prepare_decode_graph(rows, lens)`` /
    #: ``prepare_verify_graph(rows, lens, q_len)`` prepare a decode / q_len rows per request
    #: from device tensors (CUDA-graph capturable); ``plan_decode_graph`` plans on the host;
    #: ``prepare_extend_graph(meta, max_ext_len)`` a prefill step (hardware plugins read this).
    prepares_decode_on_device: bool = False
    prepares_verify_on_device: bool = False
    plans_decode_on_host: bool = False
    prepares_extend_on_device: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (KV index lists, masks) shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens.

        Returns [T, num_heads * head_dim].
        """


class CausalLM(ABC):
    """A model architecture written for batched, paged inference."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; return logits [len(batch.logits_indices), vocab] in float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF-style name, tensor) pairs; raise on a missing or unexpected tensor."""


class Grammar(ABC):
    """A matcher over one compiled grammar, for one request (its state lives on the control side).

    Rules:
    - ``accept_token`` advances by exactly one token, or returns False and leaves the state as it
      was. Accepting a stop token while the output is complete terminates the matcher; that
      stop token counts as one accepted token.
    - ``rollback(k)`` undoes exactly the last k accepted tokens (a terminating stop token
      included), so speculative decoding can reject drafts.
    - ``fill_bitmask`` writes only row ``index`` of the batch bitmask (format: see
      ``GrammarBackend``); a stop token is allowed exactly when the output so far is complete.
    - ``forced_string`` and ``fill_bitmask`` never change the state.
    - Matchers are used from one thread at a time; ``copy`` may run on another thread than the
      matcher it copies.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the token breaks the grammar (state unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed-token mask of the current state into ``bitmask[index]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the output was complete."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def forced_string(self) -> str:
        """The text every valid continuation starts with from here ("" if none): jump-forward
        decoding appends it without sampling. Whole UTF-8 characters only."""

    @abstractmethod
    def copy(self) -> Grammar:
        """A new matcher in the initial state over the same compiled grammar (cheap: compiled
        grammars are cached and each request gets its own copy)."""

    def memory_bytes(self) -> int:
        """About how many bytes the compiled grammar holds (shared by its copies); 0 when
        unknown. The engine's cache of compiled grammars is bounded by their sum."""
        return 0

    def min_output_tokens(self) -> int:
        """A lower bound on the tokens of any complete output (0 when unknown). The engine
        refuses a request whose ``max_new_tokens`` is smaller: its output could only end cut
        off, and invalid."""
        return 0


GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarBackend(ABC):
    """Compiles grammar specs into matchers for one tokenizer; owns the bitmask format.

    Built by the registered ``factory(tokenizer, vocab_size, stop_token_ids)``: ``tokenizer`` is
    the engine's ``radixserve.core.tokenizer.Tokenizer``, ``vocab_size`` the model's logits
    width (the mask width) and ``stop_token_ids`` the tokens that end an output.

    Bitmask format: int32 tensor [rows, ceil(vocab_size / 32)]; bit j of word i is 1 when token
    ``32 * i + j`` is allowed. The engine allocates it once (``allocate_bitmask``), fills the rows
    of the step's constrained requests (``fill_bitmasks``) and masks their logits in one call
    (``apply_bitmask``), once per step. ``compile`` runs on a worker thread, possibly on two at
    once; the other methods run on the engine's thread.
    """

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Grammar:
        """Compile ``spec`` of ``kind`` (one of ``GRAMMAR_KINDS``) into a matcher in its initial
        state. Raise ValueError naming the problem on a bad or unsupported spec."""

    def allocate_bitmask(self, rows: int, vocab_size: int) -> torch.Tensor:
        """A host bitmask of ``rows`` rows with every token allowed."""
        import torch

        return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_bitmasks(self, grammars: Sequence[tuple[int, Grammar]], bitmask: torch.Tensor) -> None:
        """Fill ``bitmask[row]`` for each (row, matcher); backends may do it in parallel."""
        for row, grammar in grammars:
            grammar.fill_bitmask(bitmask, row)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set ``logits[r, t]`` to -inf, in place, for each row r in ``rows`` and each token t
        whose bit in ``bitmask[r]`` is 0. ``bitmask`` is on the logits' device."""
        import torch

        vocab = logits.shape[-1]
        index = torch.tensor(rows, device=logits.device)
        shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
        bits = (bitmask[index].unsqueeze(-1) >> shifts) & 1
        banned = bits.view(len(rows), -1)[:, :vocab] == 0
        logits[index] = logits[index].masked_fill(banned, float("-inf"))


class StepStrategy:
    """A capability that changes the engine's step (speculation, prefill/decode
    disaggregation, ...), plugged in at the fixed points of the loop (core/engine_core.py),
    the scheduler (core/scheduler.py) and the model runner (core/model_runner.py). Those call
    every enabled strategy at each point, in order, and never ask which one it is. Every hook
    has a default that changes nothing, so a strategy implements only its own.

    The loop is, per step: ``poll`` each strategy; let one ``run_own_step`` (a step it runs
    itself, e.g. on the device); else the scheduler plans (``extend_plan`` adds extra rows),
    the runner executes the plan (``add_rows``, ``before_forward``, ``after_forward``,
    ``sample_rows``), and the scheduler commits it (``before_commit``, ``committed``); then
    ``step_done`` and ``ended``.

    Invariants: KV slots are allocated and freed only through the scheduler and written only
    through the slot table (core/memory.py), and what a strategy allocated for extra rows is
    in the plan when ``extend_plan`` returns, or freed by then; a request is in one place
    only (the scheduler, a strategy that ``admit`` took it into, or ended); hooks run on the
    engine's thread and never block (``wait_timeout`` says how long the engine may sleep).
    """

    # -- the request lifecycle (engine core) --------------------------------------------------

    def prepare(self, req: Any) -> None:
        """A request arrives, before validation: the strategy may rewrite its prompt (a
        session puts its context first, core/sessions.py). Raise InvalidRequest to refuse."""

    def admit(self, req: Any, compiling: bool) -> bool:
        """A validated request arrives (``compiling``: its grammar compiles first, and it
        comes back through ``admit_compiled``). Raise InvalidRequest to refuse it; return True
        when the strategy holds it (the scheduler must not queue it: the strategy hands it
        over, e.g. once its KV arrived), False to let it run as usual."""
        return False

    def admit_compiled(self, req: Any) -> bool | None:
        """``req``'s grammar compiled. None: admit it as usual (jump-forward, then the
        scheduler); False: the strategy took it; True: it ended instead (finished)."""
        return None

    def admissible(self, req: Any) -> bool:
        """Whether waiting ``req`` may start running now (e.g. its LoRA adapter got a slot);
        False: it waits and admission goes on with the next request."""
        return True

    def refused(self, req: Any, message: str) -> None:
        """This server refused ``req`` (validation, ``admit``) with ``message``; tell a peer
        that waits for it."""

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None, refused: bool = True
    ) -> None:
        """This server refused a request of ``room`` (see EngineCore.cancel_room): tell the
        peer that waits for it, unless the room belongs to a live request."""

    def ended_unscheduled(self, reqs: list[Any]) -> None:
        """``reqs`` ended before the scheduler saw them (their grammar failed to compile)."""

    def poll(self) -> list[Any]:
        """Before each step: requests that changed outside a step (ended, got a token)."""
        return []

    def ended(self, reqs: list[Any]) -> None:
        """After each step and each abort: ``reqs`` changed (some finished)."""

    def abort(self, rid: str, message: str) -> Any | None:
        """Abort ``rid`` if the strategy holds it (``admit``); return it finished, else None."""
        return None

    def has_work(self) -> bool:
        """Whether the strategy has work of its own (requests it holds, a step it runs)."""
        return False

    def wait_timeout(self) -> float | None:
        """Seconds the engine may sleep when the strategy's only work waits on something
        outside the engine (KV arriving); None: it has no such wait."""
        return None

    def drain(self, scheduler: Any) -> list[Any]:
        """Stop any step the strategy runs itself; its requests go back to the scheduler,
        whole (its state is about to change outside a step). Returns those that changed."""
        return []

    def close(self) -> None:
        """Let go of threads, sockets and device memory; the strategy is not called again."""

    def spec_stats(self) -> dict[str, object] | None:
        """Speculation's settings and accept statistics (/server_info); None elsewhere."""
        return None

    # -- the loop ---------------------------------------------------------------------------

    def needs_host_tokens(self, scheduler: Any) -> bool:
        """Whether the next plan needs every running request's last token on the host: the
        step in flight (overlap scheduling) is then committed before planning."""
        return False

    def run_own_step(self, scheduler: Any, hold: bool) -> tuple[list[Any], bool]:
        """Run this step instead of the scheduler's plan, where the strategy can (nothing is
        in flight; ``hold``: requests wait for the host, so it must stop instead). Returns
        the requests it changed and whether it ran the step."""
        return [], False

    def step_done(self, plan: Any, seconds: float, overlapped: bool) -> None:
        """``plan``'s result came ``seconds`` after it was planned (or the previous result
        came, if later); ``overlapped``: launched while the previous step was running."""

    # -- the scheduler ----------------------------------------------------------------------

    def extend_plan(self, scheduler: Any, decodes: list[Any]) -> dict[str, Draft]:
        """Extra rows for some of this step's ``decodes`` (their decode slot is allocated):
        rid -> the rows, whose KV slots (positions kv_len + 1 ..) the strategy allocated
        through ``scheduler``. Those entries extend over their last token and the rows, and
        their step emits a list of tokens (``sample_rows``)."""
        return {}

    def before_commit(self, scheduler: Any, req: Any, extra: Draft, tokens: list[Any]) -> None:
        """Before an extended entry's ``tokens`` are appended: arrange its slots so that the
        positions the tokens follow come first (the scheduler keeps kv_len + the tokens kept
        and frees the rest)."""

    def committed(self, plan: Any, outcomes: list[tuple[Any, Draft, int, int]]) -> None:
        """After the scheduler committed ``plan``: per extended entry (request, extra rows,
        tokens emitted, tokens kept). Rolling back is done: each request's KV holds exactly
        its kept tokens (the rest of the rows' slots are freed)."""

    def released(self, req: Any) -> None:
        """``req``'s KV and row were given back (finished, aborted, retracted): forget it."""

    def on_release(self, scheduler: Any, req: Any) -> None:
        """``req``'s slots are about to be given back (they still hold its KV)."""

    def pinned_tokens(self) -> int:
        """Cached tokens the strategy keeps locked while no request runs (session pins)."""
        return 0

    # -- the model runner -------------------------------------------------------------------

    def add_rows(self, rows: Any, index: int, req: Any, n: int, extra: Draft) -> bool:
        """Add plan entry ``index`` (``n`` new tokens, ``extra``) to ``rows``
        (core/step_rows.py); False when the strategy did not extend it."""
        return False

    def before_forward(self, batch: ForwardBatch) -> None:
        """The step's ForwardBatch is built; ask the model for what the strategy reads."""

    def after_forward(self, batch: ForwardBatch) -> None:
        """The model ran ``batch`` (its kept hidden states are set)."""

    def sample_rows(
        self, logits: torch.Tensor, plan: Any, plans: list[Any], sample: list[int], eos: Any
    ) -> dict[int, Any] | None:
        """Sample a plan with extended entries: {batch index: token (a list of tokens for an
        extended entry)} for each of ``sample``; None when it has none of the strategy's."""
        return None
