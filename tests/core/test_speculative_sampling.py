"""Speculative decoding keeps the target's sampling distribution, and its acceptance extremes.

1. Distribution: on a tiny random Llama with a 16-token vocabulary, 2,000 seeded requests of
   one prompt sample 4 tokens each (``ignore_eos``); drafts of 2 tokens cover tokens 2 and 3
   (token 1 comes from the prefill, token 4 from the target or a later step). The empirical
   distribution is compared with the target's exact one, computed by teacher forcing the same
   weights in ``transformers`` over every prefix (16^0 + .. + 16^3 contexts): Pearson
   chi-square tests of the marginals of tokens 2, 3 and 4 and of the pair (token 2, token 3),
   cells with expected count < 5 pooled, combined by Bonferroni (p = 4 * the smallest). Drafts:
   the target itself, a random model of another seed, and an in-process drafter whose q lies
   wholly outside the target's top-k (acceptance 0); speculation off is the control. Two lossy
   acceptance rules patched into ``core.spec_verify._rejection_sample`` (accept every draft;
   on rejection draw from p instead of the residual) must make the same check fail.
2. Acceptance extremes (greedy, the 384-token tiny model): a self-draft accepts every draft
   token of every verify step; a random draft accepts almost none and changes no output.
3. Seeded sampling: drafts without probabilities change no output token of seeded sampled
   (or greedy) requests.

The chi-square tests are marked slow (about 40 s together on 2 CPU cores); the rest takes
about 2 s. The distribution runs drive ``EngineCore`` from the test thread, all requests added
before the first step, so batches (and the draft model's unseeded draws from the
engine-seeded global generator) are the same every run.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from platform_choice import on_cpu
from tiny_models import make_tiny_llama_dir

import radixserve.core.spec_tree as spec_tree
import radixserve.core.spec_verify as spec_verify
import radixserve.core.speculative as core_spec
from radixserve import Engine
from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.plugins import PluginHost
from radixserve.core.request import Req, SamplingParams
from radixserve.core.sampling import adjusted_logits, target_probs

VOCAB = 16
PROMPT = [3, 4, 5]
NEW_TOKENS = 4
NUM_REQUESTS = 2000
DRAFT_STEPS = 2
ALPHA = 1e-3  # a correct rule fails at this level once in a thousand seed budgets
LOSSY_MAX_P = 1e-6  # a lossy rule must be rejected far beyond doubt

TEMP1 = {"temperature": 1.0}
FILTERED = {"temperature": 0.8, "top_k": 8, "top_p": 0.9}
TOP5 = {"temperature": 1.0, "top_k": 5}


# -- chi-square -----------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1.0:  # series for the lower P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # Lentz's continued fraction for Q
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square_p(observed: dict[Any, int], expected_probs: dict[Any, float], n: int) -> float:
    """Pearson's goodness-of-fit p-value; cells expecting < 5 counts are pooled into one (with
    the smallest other cell if still < 5). A cell the reference calls impossible that was
    observed gives p = 0."""
    if sum(observed.values()) != n:
        raise AssertionError("observed counts do not sum to n")
    for key, count in observed.items():
        if count and expected_probs.get(key, 0.0) <= 0.0:
            return 0.0
    cells = [(n * p, observed.get(key, 0)) for key, p in expected_probs.items() if p > 0.0]
    big = sorted((c for c in cells if c[0] >= 5.0), key=lambda c: c[0])
    small = [c for c in cells if c[0] < 5.0]
    if small:
        pooled = (sum(e for e, _ in small), sum(o for _, o in small))
        if pooled[0] < 5.0 and big:
            e, o = big.pop(0)
            pooled = (pooled[0] + e, pooled[1] + o)
        big.append(pooled)
    stat = sum((o - e) ** 2 / e for e, o in big)
    return chi2_sf(stat, len(big) - 1)


def test_chi2_sf_matches_tables() -> None:
    # Known upper quantiles: chi2(1) 3.841 -> 0.05, chi2(10) 18.307 -> 0.05, 23.209 -> 0.01,
    # chi2(3) 16.266 -> 0.001; and chi2(2) is Exp(1/2): sf(x) = exp(-x/2) exactly.
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(23.209251, 10) == pytest.approx(0.01, rel=1e-5)
    assert chi2_sf(16.266236, 3) == pytest.approx(0.001, rel=1e-5)
    for x in (0.5, 3.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
    assert chi2_sf(500.0, 20) < 1e-80


# -- the target's exact distribution ---------------------------------------------------------


def filtered_probs(logits: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """core.sampling's distribution: softmax(logits / T) in the top-k and the top-p nucleus
    (a token stays while the mass before it is below top_p), normalized. Raises on a near tie
    at a filter boundary, where float noise could make the engine choose differently."""
    probs = torch.softmax(logits.double() / params.get("temperature", 1.0), dim=-1)
    top_k, top_p = params.get("top_k", -1), params.get("top_p", 1.0)
    ordered, order = probs.sort(descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
        gap = math.log(float(ordered[top_k - 1]) / float(ordered[top_k]))
        assert gap > 1e-5, "near tie at the top-k edge"  # float32 logits differ by ~1e-6
    before = ordered.cumsum(0) - ordered
    if top_p < 1.0:
        assert float((before - top_p).abs().min()) > 1e-6, "near tie at the top-p edge"
        keep &= before < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = ordered[keep]
    return out / out.sum()


class Reference:
    """Exact next-token logits of the target after ``PROMPT + suffix`` for every suffix of up
    to NEW_TOKENS - 1 tokens, from ``transformers`` (independent of radixserve's model code)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.logits: dict[tuple[int, ...], torch.Tensor] = {}
        for length in range(NEW_TOKENS):
            suffixes = list(itertools.product(range(VOCAB), repeat=length))
            ids = torch.tensor([PROMPT + list(s) for s in suffixes])
            with torch.no_grad():
                last = model(input_ids=ids).logits[:, -1, :].double()
            self.logits.update(zip(suffixes, last, strict=True))

    def probs(self, suffix: Sequence[int], params: dict[str, Any]) -> torch.Tensor:
        return filtered_probs(self.logits[tuple(suffix)], params)

    def joint(self, params: dict[str, Any]) -> torch.Tensor:
        """P(t1 .. tN) as a [VOCAB] * NEW_TOKENS tensor."""
        joint = self.probs((), params)
        for length in range(1, NEW_TOKENS):
            suffixes = itertools.product(range(VOCAB), repeat=length)
            cond = torch.stack([self.probs(s, params) for s in suffixes])
            joint = joint.reshape(-1, 1) * cond
        return joint.reshape([VOCAB] * NEW_TOKENS)


def distribution_p(outputs: list[list[int]], joint: torch.Tensor) -> tuple[float, dict[str, float]]:
    """Bonferroni-combined p of the chi-square tests of tokens 2, 3, 4 and the pair (2, 3)."""
    assert all(len(o) == NEW_TOKENS for o in outputs)
    n = len(outputs)
    tests: dict[str, tuple[Counter[Any], torch.Tensor, Callable[[list[int]], Any]]] = {}
    for pos in (1, 2, 3):
        dims = tuple(d for d in range(NEW_TOKENS) if d != pos)
        tests[f"t{pos + 1}"] = (Counter(), joint.sum(dim=dims), lambda o, pos=pos: o[pos])
    tests["t2,t3"] = (Counter(), joint.sum(dim=(0, 3)), lambda o: (o[1], o[2]))
    ps: dict[str, float] = {}
    for name, (counts, marginal, key) in tests.items():
        counts.update(key(o) for o in outputs)
        if marginal.dim() == 1:
            expected = {t: float(marginal[t]) for t in range(VOCAB)}
        else:
            expected = {(a, b): float(marginal[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
        ps[name] = chi_square_p(dict(counts), expected, n)
    return min(1.0, len(ps) * min(ps.values())), ps


# -- drafters and lossy rules ----------------------------------------------------------------


class _Registers:
    """An in-process plugin registering one speculative algorithm built by ``factory``."""

    def __init__(self, name: str, factory: Callable[[], SpeculativeAlgorithm]) -> None:
        self.name, self.factory = name, factory

    @hookimpl
    def register_speculative_algorithms(self, register: Any) -> None:
        register(self.name, self.factory, description="test drafter")


class DisjointDrafter(SpeculativeAlgorithm):
    """Draws each draft token from q = uniform over the tokens the target cannot sample there
    (outside its top-k), looking the target's filtered distribution up in the reference."""

    def __init__(self, reference: Reference, params: dict[str, Any]) -> None:
        self.reference, self.params = reference, params
        self.rng = random.Random(1234)

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        drafts = []
        for req, limit in zip(reqs, max_drafts, strict=True):
            tokens: list[int] = []
            probs: list[torch.Tensor] = []
            for _ in range(limit):
                p = self.reference.probs(req.output_ids + tokens, self.params)
                q = (p == 0).float()
                q /= q.sum()
                tokens.append(self.rng.choice(torch.nonzero(q).flatten().tolist()))
                probs.append(q)
            drafts.append(Draft(tokens, torch.stack(probs) if tokens else None))
        return drafts


def _accept_every_draft(logits, views, firsts, drafts, draft_probs, entries, eos_ids, ids):  # type: ignore[no-untyped-def]  # noqa: ANN001, E501
    """Lossy: keep every draft token (the last row keeps the target's draw)."""
    for i in entries:
        for j, d in enumerate(drafts[i]):
            ids[firsts[i] + j] = d


def _resample_from_target(logits, views, firsts, drafts, draft_probs, entries, eos_ids, ids):  # type: ignore[no-untyped-def]  # noqa: ANN001, E501
    """Lossy: accept with probability min(1, p/q) as the core does, but on rejection draw from
    p instead of norm(max(p - q, 0)), which double-counts the accepted mass."""
    for i in entries:
        draft, first = drafts[i], firsts[i]
        rows = views[first : first + len(draft) + 1]
        p = target_probs(adjusted_logits(logits[first : first + len(rows)], rows, eos_ids), rows)
        p = p / p.sum(dim=-1, keepdim=True)
        q = draft_probs[i].to(p.device, torch.float32)
        q = q / q.sum(dim=-1, keepdim=True)
        gen = torch.Generator().manual_seed(rows[0].sampling.seed * 7919 + len(rows[0].output_ids))
        for j, d in enumerate(draft):
            if float(torch.rand(1, generator=gen)) * float(q[j, d]) < float(p[j, d]):
                ids[first + j] = d
                continue
            ids[first + j] = int(torch.multinomial(p[j], 1, generator=gen))
            break


# -- running an engine deterministically -----------------------------------------------------


def run_core(
    model_dir: Path,
    params: list[dict[str, Any]],
    prompts: list[list[int]] | None = None,
    host: PluginHost | None = None,
    **settings: Any,
) -> tuple[list[Req], dict[str, Any] | None]:
    """Add every request, then step ``EngineCore`` in this thread until all finish. Every
    step drafts (no pausing of requests whose drafts do not pay): the acceptance rule is what
    is under test."""
    settings.setdefault("speculative_disable_pause", True)
    config = EngineConfig(
        model_path=str(model_dir), dtype="float32", random_seed=0, plugin_allow=(),
        **on_cpu(settings),
    )  # fmt: skip
    core = EngineCore(model_dir, config, host or PluginHost())
    try:
        reqs = [
            Req(f"r{i}", list(prompts[i] if prompts else PROMPT), SamplingParams.from_dict(p))
            for i, p in enumerate(params)
        ]
        for req in reqs:
            core.add_request(req)
        while core.has_work():
            core.step()
        assert all(r.finish_reason is not None and r.finish_reason.type != "abort" for r in reqs)
        return reqs, core.spec_stats()
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("spec-sampling")
    target = make_tiny_llama_dir(root / "target", seed=0, vocab_size=VOCAB)
    return {
        "target": target,
        "random": make_tiny_llama_dir(root / "random", seed=1, vocab_size=VOCAB),
        "reference": Reference(target),
    }


def sample_outputs(
    small_vocab: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    draft: str,
    params: dict[str, Any],
) -> tuple[list[list[int]], dict[str, Any] | None]:
    """NUM_REQUESTS seeded requests of PROMPT with ``draft`` ('off', 'self', 'random' or
    'disjoint'), every decode drafting DRAFT_STEPS tokens (the batch-size policy lifted)."""
    monkeypatch.setattr(core_spec, "FULL_DRAFT_BATCH", 1 << 20)
    all_params = [
        {**params, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": i}
        for i in range(NUM_REQUESTS)
    ]
    settings: dict[str, Any] = {"max_running_requests": 512}
    host = None
    if draft != "off":
        settings.update(speculative_num_steps=DRAFT_STEPS, speculative_disable_batch_size=1 << 20)
    if draft in ("self", "random"):
        settings.update(
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(small_vocab["target" if draft == "self" else draft]),
        )
    elif draft == "disjoint":
        plugin = _Registers("disjoint", lambda: DisjointDrafter(small_vocab["reference"], params))
        host = PluginHost(extra_plugins=[("test_disjoint_drafter", plugin)])
        settings["plugins"] = ("speculative=disjoint",)
    reqs, stats = run_core(small_vocab["target"], all_params, host=host, **settings)
    return [r.output_ids for r in reqs], stats


# -- 1. the distribution is preserved ---------------------------------------------------------


@pytest.mark.slow  # ~25 s for the six runs of 2,000 requests
@pytest.mark.parametrize(
    ("draft", "params"),
    [
        ("off", TEMP1),
        ("self", TEMP1),
        ("self", FILTERED),
        ("random", TEMP1),
        ("random", FILTERED),
        ("disjoint", TOP5),
    ],
    ids=["off", "self", "self-topk-topp", "random", "random-topk-topp", "disjoint-topk"],
)
def test_speculation_preserves_sampling_distribution(
    small_vocab: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    draft: str,
    params: dict[str, Any],
) -> None:
    outputs, stats = sample_outputs(small_vocab, monkeypatch, draft, params)
    p, ps = distribution_p(outputs, small_vocab["reference"].joint(params))
    print(f"draft={draft} params={params} p={p:.4g} per test={ps} stats={stats}")
    assert p > ALPHA, f"sampled tokens do not follow the target's distribution: {ps}"
    if draft == "off":
        assert stats is None
        return
    assert stats is not None and stats["draft_tokens"] >= NUM_REQUESTS * DRAFT_STEPS
    rate = stats["accepted_tokens"] / stats["draft_tokens"]
    if draft == "self":  # q equals p up to float noise: min(1, p/q) is ~1
        assert rate > 0.99
    elif draft == "random":  # some overlap, far from all
        assert 0.05 < rate < 0.8
    else:  # q has no mass where p has any
        assert stats["accepted_tokens"] == 0


@pytest.mark.slow  # ~12 s
@pytest.mark.parametrize(
    ("rule", "draft", "params"),
    [
        (_accept_every_draft, "random", TEMP1),
        (_accept_every_draft, "disjoint", TOP5),
        (_resample_from_target, "random", TEMP1),
    ],
    ids=["accept-all-random", "accept-all-disjoint", "no-residual-random"],
)
def test_lossy_acceptance_rule_is_detected(
    small_vocab: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    rule: Callable[..., None],
    draft: str,
    params: dict[str, Any],
) -> None:
    monkeypatch.setattr(spec_verify, "_rejection_sample", rule)
    outputs, _ = sample_outputs(small_vocab, monkeypatch, draft, params)
    p, ps = distribution_p(outputs, small_vocab["reference"].joint(params))
    print(f"lossy {rule.__name__} draft={draft} p={p:.4g} per test={ps}")
    assert p < LOSSY_MAX_P, f"the check missed a lossy acceptance rule: {ps}"


# -- 2. acceptance extremes (greedy) -----------------------------------------------------------

K = 3
GREEDY_PROMPTS = [[5 + i, 40 + 3 * i, 7, 100 + i][: 2 + i % 3] for i in range(12)]
# 9 = 1 + 2 * (K + 1): every step drafts k; 11: the last step's draft is cut to what is left.
GREEDY_BUDGETS = [9 if i % 2 else 11 for i in range(len(GREEDY_PROMPTS))]


def full_draft_counts(max_new_tokens: int, k: int) -> tuple[int, int]:
    """(verify steps, accepted drafts) of a request whose every draft is accepted: the prefill
    gives token 1; each step drafts min(k, left - 1) and, all accepted, gains that plus one; a
    step with nothing left to draft decodes plainly."""
    produced, verify, accepted = 1, 0, 0
    while produced < max_new_tokens:
        limit = min(k, max_new_tokens - produced - 1)
        if limit > 0:
            verify, accepted = verify + 1, accepted + limit
        produced += limit + 1 if limit > 0 else 1
    return verify, accepted


def test_full_draft_counts() -> None:
    assert full_draft_counts(9, 3) == (2, 6)  # 1 | 3+1 | 3+1
    assert full_draft_counts(11, 3) == (3, 7)  # 1 | 3+1 | 3+1 | 1+1
    assert full_draft_counts(6, 3) == (1, 3)  # 1 | 3+1 | plain decode
    assert full_draft_counts(2, 3) == (0, 0)


@pytest.fixture(scope="module")
def random_384_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model of another seed with the tiny_llama_dir fixture's vocabulary."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("random-draft-384"), seed=1)


def _greedy(model_dir: Path, **settings: Any) -> tuple[list[dict[str, Any]], Any]:
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in GREEDY_BUDGETS]
    # At most 8 requests decode at once, so the draft length stays k (FULL_DRAFT_BATCH).
    with Engine(
        str(model_dir), dtype="float32", max_running_requests=8, random_seed=0, **on_cpu(settings)
    ) as engine:
        out = engine.generate(input_ids=GREEDY_PROMPTS, sampling_params=params)
        return out, engine.core.spec_stats()


def test_self_draft_accepts_everything_and_random_draft_nothing(
    tiny_llama_dir: Path, random_384_dir: Path
) -> None:
    off, _ = _greedy(tiny_llama_dir)
    # Every step drafts (a random draft would otherwise pause): exact per-step counts.
    spec = {
        "speculative_algorithm": "STANDALONE",
        "speculative_num_steps": K,
        "speculative_disable_pause": True,
        "speculative_disable_batch_size": 64,  # every request (the CPU's cut-off is 2)
    }
    selfd, self_stats = _greedy(
        tiny_llama_dir, speculative_draft_model_path=str(tiny_llama_dir), **spec
    )
    rand, rand_stats = _greedy(
        tiny_llama_dir, speculative_draft_model_path=str(random_384_dir), **spec
    )
    for o, s, r, budget in zip(off, selfd, rand, GREEDY_BUDGETS, strict=True):
        assert len(o["output_ids"]) == budget
        assert s["output_ids"] == o["output_ids"]
        assert r["output_ids"] == o["output_ids"]
        verify, accepted = full_draft_counts(budget, K)
        meta = s["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_accepted_tokens"]) == (verify, accepted)
        if (budget - 1) % (K + 1) == 0:
            assert meta["spec_accepted_tokens"] == meta["spec_verify_ct"] * K
    assert self_stats["accepted_tokens"] == self_stats["draft_tokens"] > 0
    print(f"self-draft {self_stats}; random draft {rand_stats}")

    # The random draft: full drafts at every step, almost none of them kept.
    assert rand_stats["draft_tokens"] >= len(rand) * 2 * K
    assert rand_stats["accepted_tokens"] <= 0.05 * rand_stats["draft_tokens"]
    assert (
        sum(r["meta_info"]["spec_accepted_tokens"] for r in rand) == (rand_stats["accepted_tokens"])
    )


# -- 3. seeded sampling: drafts without probabilities change nothing -----------------------------


class OracleGuesses(SpeculativeAlgorithm):
    """Drafts (without probabilities) the continuation a speculation-off run produced for the
    same prompt, with every third-ish token deliberately wrong, so verify steps both accept
    and reject; guesses past the known output are plain wrong tokens."""

    def __init__(self, known: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.known, self.vocab = known, vocab
        self.proposed = 0

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        drafts = []
        for req, limit in zip(reqs, max_drafts, strict=True):
            ref = self.known[tuple(req.input_ids)]
            start = len(req.output_ids)
            tokens = []
            for pos in range(start, start + limit):
                guess = ref[pos] if pos < len(ref) else 1
                if (pos * 7 + len(req.input_ids)) % 3 == 0:
                    guess = (guess + 1) % self.vocab
                tokens.append(guess)
            self.proposed += len(tokens)
            drafts.append(Draft(tokens))
        return drafts


SEEDED_PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 20, "min_p": 0.02},
    {"temperature": 0.9, "frequency_penalty": 0.8, "presence_penalty": 0.3},
    {"temperature": 1.1, "repetition_penalty": 1.3, "min_new_tokens": 8},
    {"temperature": 0.0},
]


def seeded_traffic() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """24 short prompts, each with one of SEEDED_PARAMS, a seed and a budget of its own."""
    prompts = [[10 + i, 20 + 2 * i, 30 + (i * 11) % 50, 2 + i % 5] for i in range(24)]
    params = [
        {
            **SEEDED_PARAMS[i % len(SEEDED_PARAMS)],
            "max_new_tokens": 12 + i % 5,
            "seed": 1000 + 17 * i,
            "ignore_eos": i % 2 == 0,
        }
        for i in range(len(prompts))
    ]
    return prompts, params


def test_seeded_sampling_with_probability_free_drafts_equals_speculation_off(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_spec, "FULL_DRAFT_BATCH", 1 << 20)
    prompts, params = seeded_traffic()
    off, _ = run_core(tiny_llama_dir, params, prompts, max_running_requests=16)
    known = {tuple(r.input_ids): list(r.output_ids) for r in off}
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    oracle = OracleGuesses(known, vocab)
    host = PluginHost(extra_plugins=[("test_oracle_drafter", _Registers("oracle", lambda: oracle))])
    on, stats = run_core(
        tiny_llama_dir,
        params,
        prompts,
        host=host,
        plugins=("speculative=oracle",),
        speculative_num_steps=4,
        speculative_disable_batch_size=1 << 20,
        max_running_requests=16,
    )
    for a, b in zip(off, on, strict=True):
        assert b.output_ids == a.output_ids, (a.sampling, a.output_ids, b.output_ids)
        assert b.finish_reason is not None and a.finish_reason is not None
        assert b.finish_reason.type == a.finish_reason.type
    assert stats is not None
    assert stats["draft_tokens"] == oracle.proposed > 0
    # Both paths ran: multi-token accepts and rejections.
    assert 0.3 * stats["draft_tokens"] < stats["accepted_tokens"] < stats["draft_tokens"]
    assert stats["avg_accept_length"] > 1.5


class OracleTrees(OracleGuesses):
    """Draft trees (``propose_trees``) around the speculation-off continuation: each node on
    the known path has a wrong sibling placed before it, and every third-ish position has only
    wrong children, so accepted paths run through later branches (the slots of positions
    kv_len + 1 .. are re-pointed) and stop part-way."""

    drafts_trees = True

    def __init__(self, known: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        super().__init__(known, vocab)
        self.trees = 0

    def propose_trees(
        self, reqs: Sequence[Req], max_depths: Sequence[int], max_nodes: Sequence[int]
    ) -> list[Draft]:
        drafts = []
        for req, depth, nodes in zip(reqs, max_depths, max_nodes, strict=True):
            if not nodes:
                drafts += self.propose([req], [depth])
                continue
            ref = self.known[tuple(req.input_ids)]
            tokens: list[int] = []
            parents: list[int] = []
            on_path = -1
            for pos in range(len(req.output_ids), len(req.output_ids) + depth):
                if len(tokens) + 2 > nodes:
                    break
                right = ref[pos] if pos < len(ref) else 1
                wrong = (right + 1) % self.vocab
                if (pos * 7 + len(req.input_ids)) % 3 == 0:
                    right = (right + 2) % self.vocab  # both children wrong here
                tokens += [wrong, right]
                parents += [on_path, on_path]
                on_path = len(tokens) - 1
            self.trees += 1
            self.proposed += len(tokens)
            drafts.append(Draft(tokens, None, None, parents))
        return drafts


def test_seeded_and_greedy_trees_equal_speculation_off(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tree verification in the core (scheduler, node rows, acceptance, re-pointed slots) with
    a drafter that knows the answer, under every sampling mode of the chain test, on a pool
    small enough to retract."""
    monkeypatch.setattr(spec_tree, "TREE_BATCH", 16)
    prompts, params = seeded_traffic()
    small = {"max_running_requests": 16, "max_total_tokens": 200, "debug_leak_check": True}
    off, _ = run_core(tiny_llama_dir, params, prompts, **small)
    known = {tuple(r.input_ids): list(r.output_ids) for r in off}
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    oracle = OracleTrees(known, vocab)
    host = PluginHost(extra_plugins=[("test_tree_oracle", _Registers("trees", lambda: oracle))])
    on, stats = run_core(
        tiny_llama_dir, params, prompts, host=host, plugins=("speculative=trees",),
        speculative_num_steps=4, speculative_eagle_topk=2,
        speculative_disable_batch_size=1 << 20, **small,
    )  # fmt: skip
    for a, b in zip(off, on, strict=True):
        assert b.output_ids == a.output_ids, (a.sampling, a.output_ids, b.output_ids)
        assert b.finish_reason is not None and a.finish_reason is not None
        assert b.finish_reason.type == a.finish_reason.type
    assert stats is not None and stats["trees"] == oracle.trees > 20
    # accepted paths both ran through second branches for several tokens and stopped short
    assert stats["avg_accept_length"] > 1.8
    assert stats["accepted_tokens"] < 4 * stats["verified_requests"]
