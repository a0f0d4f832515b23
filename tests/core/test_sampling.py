"""The sampler on fixed logits, on the CPU: sampled tokens stay inside the top-k set, the top-p
nucleus and the min-p floor (each computed here independently); the empirical distribution of
many seeded draws matches softmax(logits / T) after filtering (a chi-square test at a fixed
budget and seed, so it is deterministic); penalties change the logits by SGLang's formulas;
seeded choices are reproducible and distinct."""

from __future__ import annotations

import math

import pytest
import torch
from allow_all_grammar import AllowAllGrammar

from radixserve.core import sampling
from radixserve.core.grammar import NO_TOKEN
from radixserve.core.request import Req, SamplingParams

# Distinct values, no ties, so every filter's kept set is unambiguous.
LOGITS = [2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -1.9]
DRAWS = 12_000
# Upper 0.1% points of the chi-square distribution, by degrees of freedom (standard tables).
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def reqs_for(n: int, **params: object) -> list[Req]:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return [Req(f"r{i}", [0], sp) for i in range(n)]


def draw(logits: list[float], n: int = DRAWS, seed: int = 0, **params: object) -> list[int]:
    """``n`` independent draws (one batch row each) under a fixed torch seed."""
    batch = torch.tensor([logits] * n, dtype=torch.float32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return sampling.sample_ids(batch, reqs_for(n, **params)).tolist()


def softmax(logits: list[float], temperature: float) -> list[float]:
    m = max(logits)
    e = [math.exp((x - m) / temperature) for x in logits]
    return [x / sum(e) for x in e]


def kept_top_k(probs: list[float], k: int) -> set[int]:
    return set(sorted(range(len(probs)), key=lambda i: -probs[i])[:k])


def kept_top_p(probs: list[float], p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches ``p``."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


def kept_min_p(probs: list[float], min_p: float) -> set[int]:
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def chi_square(samples: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom. Tokens of expected probability 0 must
    never be drawn (checked here); tokens of expected count below 5 are pooled into one cell
    (and that cell into the smallest other one if it is still below 5), as the chi-square
    approximation needs."""
    counts = [0] * len(expected)
    for s in samples:
        counts[s] += 1
    assert all(counts[i] == 0 for i, q in enumerate(expected) if q == 0), counts
    n = len(samples)
    cells = sorted(((q * n, counts[i]) for i, q in enumerate(expected) if q > 0), reverse=True)
    big = [list(c) for c in cells if c[0] >= 5]
    small = [c for c in cells if c[0] < 5]
    if small:
        pooled = [sum(e for e, _ in small), sum(c for _, c in small)]
        if pooled[0] >= 5 or not big:
            big.append(pooled)
        else:
            big[-1] = [big[-1][0] + pooled[0], big[-1][1] + pooled[1]]
    return sum((c - e) ** 2 / e for e, c in big), len(big) - 1


def filtered(probs: list[float], kept: set[int]) -> list[float]:
    total = sum(probs[i] for i in kept)
    return [q / total if i in kept else 0.0 for i, q in enumerate(probs)]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k_tokens(k: int) -> None:
    probs = torch.softmax(torch.tensor([LOGITS]), dim=-1)
    out = sampling._filter_probs(probs, reqs_for(1, top_k=k))[0]
    assert set(out.nonzero().flatten().tolist()) == kept_top_k(softmax(LOGITS, 1.0), k)
    samples = set(draw(LOGITS, 4000, temperature=1.0, top_k=k))
    assert samples <= kept_top_k(softmax(LOGITS, 1.0), k)


@pytest.mark.parametrize("p", [0.3, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_nucleus(p: float) -> None:
    probs = torch.softmax(torch.tensor([LOGITS]), dim=-1)
    out = sampling._filter_probs(probs, reqs_for(1, top_p=p))[0]
    nucleus = kept_top_p(softmax(LOGITS, 1.0), p)
    assert set(out.nonzero().flatten().tolist()) == nucleus
    assert set(draw(LOGITS, 4000, temperature=1.0, top_p=p)) <= nucleus


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5, 0.9])
def test_min_p_keeps_the_floor(min_p: float) -> None:
    probs = torch.softmax(torch.tensor([LOGITS]), dim=-1)
    out = sampling._filter_probs(probs, reqs_for(1, min_p=min_p))[0]
    floor = kept_min_p(softmax(LOGITS, 1.0), min_p)
    assert set(out.nonzero().flatten().tolist()) == floor
    assert set(draw(LOGITS, 4000, temperature=1.0, min_p=min_p)) <= floor


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "size"),
    [(3, 0.95, 0.05, 3), (6, 0.9, 0.05, 4), (6, 0.99, 0.3, 3)],  # each filter binds once
)
def test_filters_combine_as_an_intersection(
    top_k: int, top_p: float, min_p: float, size: int
) -> None:
    probs = softmax(LOGITS, 0.8)
    want = kept_top_k(probs, top_k) & kept_top_p(probs, top_p) & kept_min_p(probs, min_p)
    assert len(want) == size
    out = sampling._filter_probs(
        torch.tensor([probs]), reqs_for(1, top_k=top_k, top_p=top_p, min_p=min_p)
    )[0]
    assert set(out.nonzero().flatten().tolist()) == want
    assert torch.allclose(out, torch.tensor([q if i in want else 0.0 for i, q in enumerate(probs)]))


@pytest.mark.parametrize("temperature", [0.3, 0.5, 0.8, 1.0, 1.7, 3.0])
def test_distribution_matches_softmax_over_temperature(temperature: float) -> None:
    probs = softmax(LOGITS, temperature)
    stat, df = chi_square(draw(LOGITS, temperature=temperature), probs)
    assert stat < CHI2_CRIT_001[df], (temperature, stat)


@pytest.mark.parametrize(
    ("temperature", "params", "kept"),
    [
        (0.7, {"top_k": 3}, lambda q: kept_top_k(q, 3)),
        (1.5, {"top_k": 5}, lambda q: kept_top_k(q, 5)),
        (1.0, {"top_p": 0.8}, lambda q: kept_top_p(q, 0.8)),
        (2.0, {"top_p": 0.6}, lambda q: kept_top_p(q, 0.6)),
        (1.0, {"min_p": 0.2}, lambda q: kept_min_p(q, 0.2)),
        (0.6, {"min_p": 0.1}, lambda q: kept_min_p(q, 0.1)),
    ],
)
def test_distribution_matches_filtered_softmax(temperature, params, kept) -> None:
    """Filters act on softmax(logits / T) and the kept mass is renormalized."""
    probs = softmax(LOGITS, temperature)
    expected = filtered(probs, kept(probs))
    stat, df = chi_square(draw(LOGITS, temperature=temperature, **params), expected)
    assert stat < CHI2_CRIT_001[df], (temperature, params, stat)


def test_chi_square_detects_a_wrong_temperature() -> None:
    """The budget is large enough: draws at T are far from softmax(logits / sqrt(T))."""
    for temperature in (0.5, 2.0):
        stat, df = chi_square(
            draw(LOGITS, temperature=temperature), softmax(LOGITS, math.sqrt(temperature))
        )
        assert stat > 10 * CHI2_CRIT_001[df], (temperature, stat)


def test_greedy_and_top_k_1_take_the_argmax() -> None:
    assert set(draw(LOGITS, 500, temperature=0.0)) == {0}
    assert set(draw(LOGITS, 500, temperature=5.0, top_k=1)) == {0}


def test_greedy_rows_in_a_sampled_batch_take_their_own_argmax() -> None:
    # The sampled row holds the batch's largest logit, so a flat argmax would point into it.
    logits = torch.tensor([LOGITS[::-1], [x + 1 for x in LOGITS], LOGITS[::-1]])
    reqs = [
        Req("g", [0], SamplingParams(temperature=0.0)),
        Req("s", [0], SamplingParams(temperature=1.0, seed=1)),
        Req("k", [0], SamplingParams(temperature=1.0, top_k=1)),
    ]
    out = sampling.sample_ids(logits, reqs).tolist()
    assert out[0] == 7 and out[2] == 7 and 0 <= out[1] < len(LOGITS)


def test_top_p_and_min_p_at_exact_boundaries() -> None:
    """Values exact in binary: the nucleus is the smallest set whose mass reaches top_p (as in
    HF; SGLang's torch fallback keeps one more token on an exact tie), and a token exactly at
    the min-p floor stays (as in SGLang)."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    nucleus = sampling._filter_probs(probs, reqs_for(1, top_p=0.75))[0]
    assert nucleus.tolist() == [0.5, 0.25, 0.0, 0.0]
    floor = sampling._filter_probs(probs, reqs_for(1, min_p=0.25))[0]
    assert floor.tolist() == [0.5, 0.25, 0.125, 0.125]
    assert sampling._filter_probs(probs, reqs_for(1, min_p=0.5))[0].tolist() == [0.5, 0.25, 0, 0]


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 1e-9])
def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token(top_p: float) -> None:
    """1e-46 rounds to 0 in float32: the nucleus must still hold the first token (it once
    dropped every token, and the sampler then drew token 0)."""
    probs = torch.tensor([[0.125, 0.5, 0.25, 0.125]])
    kept = sampling._filter_probs(probs, reqs_for(1, top_p=top_p))[0]
    assert kept.tolist() == [0.0, 0.5, 0.0, 0.0]
    assert draw([0.1, 2.0, -1.0, 0.3], n=200, top_p=top_p, temperature=1.0) == [1] * 200


# --- penalties, on the logits (SGLang's formulas) ---------------------------------------


def penalized(logits: list[float], prompt: list[int], output: list[int], **params) -> list[float]:
    req = Req("r", prompt, SamplingParams(**params))
    req.output_ids = list(output)
    return sampling._apply_penalties(torch.tensor([logits]), [req])[0].tolist()


PEN_LOGITS = [1.5, -0.5, 2.0, 0.0, -1.25, 0.75]


def test_frequency_penalty_subtracts_penalty_times_output_count() -> None:
    out = penalized(PEN_LOGITS, prompt=[4, 4], output=[0, 2, 2, 2, 1], frequency_penalty=0.5)
    counts = [1, 1, 3, 0, 0, 0]  # prompt tokens do not count
    assert out == pytest.approx([x - 0.5 * c for x, c in zip(PEN_LOGITS, counts, strict=True)])


def test_presence_penalty_subtracts_once_per_output_token() -> None:
    out = penalized(PEN_LOGITS, prompt=[4, 5], output=[0, 2, 2, 2], presence_penalty=-0.75)
    seen = [1, 0, 1, 0, 0, 0]
    assert out == pytest.approx([x + 0.75 * s for x, s in zip(PEN_LOGITS, seen, strict=True)])


@pytest.mark.parametrize("rp", [1.3, 2.0, 0.5])
def test_repetition_penalty_divides_positive_multiplies_negative(rp: float) -> None:
    out = penalized(PEN_LOGITS, prompt=[1, 3, 5], output=[0, 4], repetition_penalty=rp)
    seen = {0, 1, 3, 4, 5}  # prompt and output both count; 5 is in (0, 1)
    want = [(x / rp if x > 0 else x * rp) if i in seen else x for i, x in enumerate(PEN_LOGITS)]
    assert out == pytest.approx(want)


def test_a_tiny_repetition_penalty_keeps_the_logits_finite() -> None:
    """1e-40 would divide a positive logit to inf, and softmax would give nan."""
    out = penalized(PEN_LOGITS, prompt=[0, 1], output=[2], repetition_penalty=1e-40)
    assert all(math.isfinite(x) for x in out)
    assert min(out[0], out[2]) > PEN_LOGITS[3] > out[1]  # boosted, and the negative one cut
    probs = torch.softmax(torch.tensor(out), -1)
    assert not probs.isnan().any() and set(probs.nonzero().flatten().tolist()) <= {0, 2}


def test_frequency_penalty_without_output_changes_nothing() -> None:
    out = penalized(PEN_LOGITS, prompt=[1, 2], output=[], frequency_penalty=1.0)
    assert out == PEN_LOGITS


def test_frequency_and_presence_add_up() -> None:
    out = penalized(
        PEN_LOGITS, prompt=[3], output=[5, 5, 1], frequency_penalty=0.25, presence_penalty=1.0
    )
    counts = [0, 1, 0, 0, 0, 2]
    want = [x - 0.25 * c - 1.0 * (c > 0) for x, c in zip(PEN_LOGITS, counts, strict=True)]
    assert out == pytest.approx(want)


def test_no_penalty_leaves_logits_and_rows_apart() -> None:
    logits = torch.tensor([PEN_LOGITS, PEN_LOGITS])
    plain = Req("a", [0, 1], SamplingParams())
    plain.output_ids = [2, 2]
    pen = Req("b", [0, 1], SamplingParams(frequency_penalty=1.0))
    pen.output_ids = [2, 2]
    out = sampling._apply_penalties(logits, [plain, pen])
    assert out[0].tolist() == PEN_LOGITS
    assert out[1].tolist() == pytest.approx([1.5, -0.5, 0.0, 0.0, -1.25, 0.75])
    assert logits[1].tolist() == PEN_LOGITS  # the input is not changed in place


# --- seeds ------------------------------------------------------------------------------


def test_seeded_choices_reproducible_and_distinct() -> None:
    """n choices of one seeded request get seeds seed + index (entrypoints/fanout.py): each
    choice's draws repeat exactly, and the choices differ from each other."""
    from radixserve.entrypoints.fanout import choice_params

    base = SamplingParams(temperature=1.0, seed=2**64 - 2, n=4)
    logits = torch.tensor([LOGITS] * 4)

    def run() -> list[list[int]]:
        reqs = [Req(f"c{i}", [0], choice_params(base, i)) for i in range(4)]
        rows = []
        for _ in range(32):  # 32 positions: the seed is keyed by output position
            rows.append(sampling.sample_ids(logits, reqs).tolist())
            for r, t in zip(reqs, rows[-1], strict=True):
                r.output_ids.append(t)
        return [list(col) for col in zip(*rows, strict=True)]

    with torch.random.fork_rng():
        torch.manual_seed(1)
        first = run()
        torch.manual_seed(2)  # the global generator must not matter for seeded rows
        second = run()
    assert first == second
    assert len({tuple(c) for c in first}) == 4
    assert [choice_params(base, i).seed for i in range(4)] == [2**64 - 2, 2**64 - 1, 0, 1]


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=99)
    alone = sampling.sample_ids(torch.tensor([LOGITS]), [Req("a", [0], seeded)]).item()
    other = Req("b", [0], SamplingParams(temperature=2.0))
    batch = torch.tensor([LOGITS[::-1], LOGITS])
    assert sampling.sample_ids(batch, [other, Req("a", [0], seeded)])[1].item() == alone


def test_row_seed_folds_into_63_bits() -> None:
    assert sampling.row_seed(5, 3) == 5 * 1_000_003 + 3
    assert 0 <= sampling.row_seed(2**64 - 1, 7) < 2**63
    assert sampling.row_seed(2**64 - 1, 7) == ((2**64 - 1) * 1_000_003 + 7) % 2**63


# --- sample(): min-tokens masking, penalties, logprobs, a failing row ------------------------

EOS = 7


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    early = Req("a", [0], SamplingParams(min_new_tokens=2, stop_token_ids=[0]))
    early.output_ids = [3]
    done = Req("b", [0], SamplingParams(min_new_tokens=1, stop_token_ids=[0]))
    done.output_ids = [3]
    plain = Req("c", [0], SamplingParams())
    out = sampling.mask_until_min_tokens(logits, [early, done, plain], [EOS])
    assert out[0, 0] == -math.inf and out[0, EOS] == -math.inf
    assert out[0, 1:EOS].tolist() == pytest.approx(LOGITS[1:EOS])
    assert out[1].tolist() == pytest.approx(LOGITS) and out[2].tolist() == pytest.approx(LOGITS)
    assert logits[0].tolist() == pytest.approx(LOGITS)  # not in place
    greedy = Req("g", [0], SamplingParams(temperature=0.0, min_new_tokens=1, stop_token_ids=[0]))
    assert sampling.sample(torch.tensor([LOGITS]), [greedy], [EOS]).next_ids == [1]


def test_sample_applies_penalties_before_choosing() -> None:
    req = Req("r", [5], SamplingParams(temperature=0.0, frequency_penalty=0.5))
    req.output_ids = [0]  # 2.0 - 0.5 < 1.6
    assert sampling.sample(torch.tensor([LOGITS]), [req], [EOS]).next_ids == [1]


def test_sample_logprobs_from_the_raw_logits() -> None:
    raw = torch.tensor([LOGITS, LOGITS])
    masked = raw.clone()
    masked[0, 0] = -math.inf  # e.g. a grammar mask: the choice moves, logprobs stay raw
    want = Req("a", [0], SamplingParams(temperature=0.0, logprobs=True, top_logprobs_num=3))
    none = Req("b", [0], SamplingParams(temperature=0.0))
    result = sampling.sample(masked, [want, none], [EOS], raw=raw)
    logp = torch.log_softmax(raw[0], dim=-1).tolist()
    assert result.next_ids == [1, 0]
    assert result.logprobs == pytest.approx([logp[1], 0.0])
    assert result.top_logprobs is not None and result.top_logprobs[1] == []
    assert [i for _, i in result.top_logprobs[0]] == [0, 1, 2]
    assert [v for v, _ in result.top_logprobs[0]] == pytest.approx(logp[:3])
    plain = sampling.sample(raw, [none, none], [EOS])
    assert plain.logprobs is None and plain.top_logprobs is None
    few = Req("c", [0], SamplingParams(temperature=0.0, logprobs=True))
    result = sampling.sample(raw, [few, want], [EOS])
    assert result.top_logprobs is not None and result.top_logprobs[0] == []
    assert len(result.top_logprobs[1]) == 3


def _broken(**params: object) -> Req:
    """A request whose penalty step fails (an output id outside the vocabulary)."""
    req = Req("bad", [0], SamplingParams(**params))  # type: ignore[arg-type]
    req.output_ids = [len(LOGITS) + 5]
    return req


def test_a_failing_row_fails_alone() -> None:
    good = Req("good", [0], SamplingParams(temperature=0.0, logprobs=True, top_logprobs_num=1))
    bad = _broken(temperature=0.0, frequency_penalty=1.0, logprobs=True)
    logits = torch.tensor([LOGITS[::-1], LOGITS])
    result = sampling.sample(logits, [good, bad], [EOS])
    assert result.next_ids == [7, 0]  # the failed row gets its argmax
    assert good.failed is None and bad.failed and "sampling failed" in bad.failed
    assert "(RuntimeError: " in bad.failed  # the message names the error
    assert result.logprobs is not None and result.logprobs[1] == 0.0
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[7].item())
    assert result.top_logprobs is not None and result.top_logprobs[1] == []
    assert len(result.top_logprobs[0]) == 1
    with pytest.raises(RuntimeError):
        sampling.sample(torch.tensor([LOGITS]), [_broken(frequency_penalty=1.0)], [EOS])
    good2 = Req("g2", [0], SamplingParams(temperature=0.0))
    bad2 = _broken(temperature=0.0, frequency_penalty=1.0)
    result = sampling.sample(logits, [good2, bad2], [EOS])
    assert result.next_ids == [7, 0] and result.logprobs is None and result.top_logprobs is None


def test_a_failing_row_in_sample_ids_fails_alone() -> None:
    bad = Req("bad", [0], SamplingParams(temperature=1.0))
    bad.sampling.seed = "not a number"  # type: ignore[assignment]  # past validation
    seeded = SamplingParams(temperature=1.0, seed=4)
    flat = [0.0] * len(LOGITS)  # argmax 0; seed 4 draws another token
    logits = torch.tensor([LOGITS[::-1], flat])
    alone = sampling.sample_ids(logits[1:], [Req("s", [0], seeded)]).item()
    assert alone != 0
    good = Req("s", [0], seeded)
    out = sampling.sample_ids(logits, [bad, good]).tolist()
    assert out == [7, alone] and bad.failed and "sampling failed" in bad.failed
    assert good.failed is None
    with pytest.raises(TypeError):
        sampling.sample_ids(logits[:1], [bad])


def test_a_failing_row_leaves_the_others_sampled_in_full() -> None:
    """The row-by-row retry gives each good row its own min-tokens mask, seed and raw logits."""
    params = SamplingParams(temperature=1.0, seed=5, min_new_tokens=1, logprobs=True)
    raw = torch.zeros(2, len(LOGITS))
    logits = raw.clone()
    logits[0, 1] = -math.inf  # a mask: logprobs still come from raw
    alone = sampling.sample(logits[:1], [Req("s", [0], params)], [EOS], raw=raw[:1])
    assert alone.next_ids[0] not in (0, 1, EOS)
    good = Req("s", [0], params)
    bad = _broken(temperature=0.0, frequency_penalty=1.0)
    result = sampling.sample(logits, [good, bad], [EOS], raw=raw)
    assert good.failed is None and bad.failed
    assert result.next_ids == [alone.next_ids[0], 0]
    assert result.logprobs is not None
    assert result.logprobs[0] == pytest.approx(-math.log(len(LOGITS)))


def test_a_failing_middle_row_of_three_fails_alone() -> None:
    """The retry takes exactly row i of the logits and of the raw logits for request i: with
    the failing row in the middle, the rows on either side keep their own choice and logprobs
    (a two-row batch cannot tell ``[i : i + 1]`` from a slice one row off)."""
    raw = torch.tensor([LOGITS[::-1], LOGITS, [2 * x for x in LOGITS]])
    logits = raw.clone()
    logits[2, 0] = -math.inf  # row 2 is masked off its raw argmax (0): it takes 1
    params = {"temperature": 0.0, "logprobs": True, "top_logprobs_num": 2}
    first, last = Req("a", [0], SamplingParams(**params)), Req("c", [0], SamplingParams(**params))
    bad = _broken(temperature=0.0, frequency_penalty=1.0)
    result = sampling.sample(logits, [first, bad, last], [EOS], raw=raw)
    assert result.next_ids == [7, 0, 1]
    assert first.failed is None and last.failed is None and bad.failed
    expected = torch.log_softmax(raw, dim=-1)
    assert result.logprobs is not None and result.top_logprobs is not None
    assert result.logprobs[0] == pytest.approx(expected[0, 7].item())
    assert result.logprobs[1] == 0.0 and result.top_logprobs[1] == []
    assert result.logprobs[2] == pytest.approx(expected[2, 1].item())
    assert [t for _, t in result.top_logprobs[2]] == [0, 1]  # the raw row's best, unmasked


def test_the_retry_draws_each_good_row_as_if_sampled_alone() -> None:
    """Under a fixed torch seed, the rows around a failing one draw exactly what they draw
    sampled alone, one after the other: the retry consumes noise for one row at a time."""
    flat = torch.zeros(3, len(LOGITS))
    params = SamplingParams(temperature=1.0)

    def alone() -> list[int]:
        return [
            sampling.sample(flat[i : i + 1], [Req(f"r{i}", [0], params)], [EOS]).next_ids[0]
            for i in (0, 2)
        ]

    for seed in range(4):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            reference = alone()
            torch.manual_seed(seed)
            bad = _broken(temperature=1.0, frequency_penalty=1.0)
            batch = [Req("r0", [0], params), bad, Req("r2", [0], params)]
            result = sampling.sample(flat, batch, [EOS])
        assert bad.failed
        assert [result.next_ids[0], result.next_ids[2]] == reference, seed


def test_a_failing_middle_row_in_sample_ids_fails_alone() -> None:
    """sample_ids' retry: one id per row, each good row drawn from its own logits and seed, the
    failing row's argmax from its own row."""
    flat = torch.zeros(3, len(LOGITS))
    flat[1] = torch.tensor(LOGITS[::-1])  # the failing row's argmax is 7
    reqs = [Req(f"s{i}", [0], SamplingParams(temperature=1.0, seed=10 + i)) for i in range(3)]
    alone = [sampling.sample_ids(flat[i : i + 1], [reqs[i]]).item() for i in (0, 2)]
    reqs[1].sampling.seed = "not a number"  # type: ignore[assignment]  # past validation
    out = sampling.sample_ids(flat, reqs).tolist()
    assert out == [alone[0], 7, alone[1]]
    assert reqs[1].failed and reqs[0].failed is None and reqs[2].failed is None


# --- grammar rows: a constrained row with no allowed token ---------------------------------------


class StubGrammar(AllowAllGrammar):
    """The sampler only asks whether a row is constrained."""


def _constrained(rid: str, **params: object) -> Req:
    req = Req(rid, [0], SamplingParams(**params))  # type: ignore[arg-type]
    req.grammar = StubGrammar()
    return req


def test_a_grammar_row_with_no_allowed_token_gets_no_token() -> None:
    """The masks left a constrained row nothing (all -inf): it gets NO_TOKEN, whatever its
    sampling; constrained rows with allowed tokens and unconstrained rows keep their choice
    (an unconstrained row is never marked, even all -inf)."""
    raw = torch.tensor([LOGITS] * 4)
    masked = raw.clone()
    masked[0] = -math.inf  # dead, greedy
    masked[1, :3] = -math.inf  # allowed 3..7: greedy takes 3
    masked[2] = -math.inf  # dead, sampled
    reqs = [
        _constrained("dead", temperature=0.0),
        _constrained("alive", temperature=0.0, logprobs=True),
        _constrained("dead-sampled", temperature=1.0, seed=1),
    ]
    result = sampling.sample(masked[:3], reqs, [EOS], raw=raw[:3])
    assert result.next_ids == [NO_TOKEN, 3, NO_TOKEN]
    assert result.logprobs is not None
    assert result.logprobs[1] == pytest.approx(torch.log_softmax(raw[1], -1)[3].item())
    # Beside an unconstrained row: only the constrained dead row is marked.
    masked[3] = -math.inf
    free = Req("free", [0], SamplingParams(temperature=0.0))
    mixed = sampling.sample(masked[[0, 3]], [reqs[0], free], [EOS], raw=raw[[0, 3]])
    assert mixed.next_ids == [NO_TOKEN, 0]


# --- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_adds_exact_values_to_its_own_rows_only() -> None:
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    a = Req("a", [0], SamplingParams.from_dict({"logit_bias": {"0": -3.5, "06": 2.25}}))
    b = Req("b", [0], SamplingParams())
    c = Req("c", [0], SamplingParams.from_dict({"logit_bias": {"6": 100}}))
    out = sampling.adjusted_logits(logits, [a, b, c], [EOS])
    want_a = list(LOGITS)
    want_a[0] -= 3.5
    want_a[6] += 2.25
    want_c = list(LOGITS)
    want_c[6] += 100
    assert out[0].tolist() == pytest.approx(want_a)
    assert out[1].tolist() == pytest.approx(LOGITS)
    assert out[2].tolist() == pytest.approx(want_c)
    assert logits[0].tolist() == pytest.approx(LOGITS)  # not in place
    # no request with a bias: the very same tensor, nothing copied
    assert sampling.apply_logit_bias(logits, [b, b, b]) is logits


def test_logit_bias_steers_greedy_and_sampled_choices_and_bans() -> None:
    force = {"logit_bias": {"5": 100}}
    for temperature in (0.0, 1.0):
        reqs = reqs_for(64, temperature=temperature)
        for r in reqs:
            r.sampling = SamplingParams.from_dict({**force, "temperature": temperature})
        ids = sampling.sample(torch.tensor([LOGITS] * 64), reqs, [EOS]).next_ids
        assert ids == [5] * 64
    ban = Req("g", [0], SamplingParams.from_dict({"temperature": 0, "logit_bias": {"0": -100}}))
    assert sampling.sample(torch.tensor([LOGITS]), [ban], [EOS]).next_ids == [1]
    # the overlap path (presample_logits + sample_ids) applies it too
    fast = sampling.sample_ids(
        sampling.presample_logits(torch.tensor([LOGITS]), [ban], [EOS]), [ban]
    )
    assert fast.tolist() == [1]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"8": 1.0}, r"token ids \[0, 8\)"),
        ({"-1": 1.0}, "token ids"),
        ({"abc": 1.0}, "token ids"),
        ({"1.5": 1.0}, "token ids"),
        ({"1": 100.5}, r"in \[-100.0, 100.0\]"),
        ({"1": float("nan")}, "finite"),
        ({"1": "high"}, "must be a number"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_logit_bias_is_refused_naming_the_field(bias: object, message: str) -> None:
    from radixserve.core.request import InvalidRequest

    params = SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=message) as e:
        params.validate(vocab_size=8)
    assert e.value.param == "logit_bias"


# --- the top-k prefilter (no sort of the whole vocabulary) -------------------------------


TOP_K_ROWS = [
    {"top_k": 1},
    {"top_k": 20},
    {"top_k": 50, "top_p": 0.9},
    {"top_k": 40, "min_p": 0.05},
    {"top_k": 64, "top_p": 0.5, "min_p": 0.01},
    {"top_k": 64, "top_p": 1.0},
]


def _wide_batch() -> tuple[torch.Tensor, list[Req]]:
    """A 4,096-token vocabulary (random logits, no ties) and one row per TOP_K_ROWS entry."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(TOP_K_ROWS), 4096, generator=gen) * 3
    reqs = [
        Req(f"r{i}", [0], SamplingParams(temperature=0.9, seed=i, **p))  # type: ignore[arg-type]
        for i, p in enumerate(TOP_K_ROWS)
    ]
    return logits, reqs


def test_top_k_prefilter_gives_the_full_sorts_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """When every row has a small top-k, the largest k stand in for the vocabulary sort: the
    kept tokens and their weights are exactly the full sort's, row by row."""
    logits, reqs = _wide_batch()
    probs = torch.softmax(logits, dim=-1)
    assert max(r.sampling.top_k for r in reqs) * sampling.TOP_K_PREFILTER <= probs.shape[-1]
    fast = sampling._filter_probs(probs, reqs)
    fast_ids = sampling.sample_ids(logits, reqs)
    monkeypatch.setattr(sampling, "TOP_K_PREFILTER", 10**9)  # always the full sort
    slow = sampling._filter_probs(probs, reqs)
    assert torch.equal(fast, slow)
    assert torch.equal(fast_ids, sampling.sample_ids(logits, reqs))  # seeded rows: same draws
    assert (fast[0] > 0).sum() == 1 and (fast[1] > 0).sum() == 20


def test_a_row_without_top_k_keeps_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row with top_k off (top-p only) needs the whole vocabulary: no prefilter."""
    logits, reqs = _wide_batch()
    reqs.append(Req("p", [0], SamplingParams(temperature=0.9, top_p=0.95)))
    logits = torch.cat([logits, logits[:1]])
    calls: list[int] = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(
        torch.Tensor, "topk", lambda t, *a, **k: calls.append(1) or real_topk(t, *a, **k)
    )
    out = sampling._filter_probs(torch.softmax(logits, dim=-1), reqs)
    assert not calls
    nucleus = kept_top_p(torch.softmax(logits[-1], -1).tolist(), 0.95)
    assert set(out[-1].nonzero().flatten().tolist()) == nucleus
