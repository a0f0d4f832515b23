"""Sampling parameters through the offline Engine on a tiny random model."""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_choice import CPU

from radixserve import Engine

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):
    eng = Engine(str(tiny_llama_dir), plugins=[CPU], max_total_tokens=8192)  # as transformers
    yield eng
    eng.shutdown()


def _gen(engine: Engine, **params):
    return engine.generate(PROMPT, {"max_new_tokens": 24, "ignore_eos": True, **params})


def test_fixed_seed_reproduces_output(engine: Engine) -> None:
    a = _gen(engine, temperature=1.0, seed=1234)
    b = _gen(engine, temperature=1.0, seed=1234)
    c = _gen(engine, temperature=1.0, seed=4321)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_seeded_output_does_not_depend_on_batch(engine: Engine) -> None:
    alone = _gen(engine, temperature=1.0, seed=7)
    batched = engine.generate(
        [PROMPT, "Hello world", "def add"],
        {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 7},
    )
    assert batched[0]["output_ids"] == alone["output_ids"]


def test_top_k_1_equals_greedy(engine: Engine) -> None:
    greedy = _gen(engine, temperature=0)
    top1 = _gen(engine, temperature=1.5, top_k=1)
    assert top1["output_ids"] == greedy["output_ids"]


def test_tiny_top_p_and_high_min_p_collapse_to_greedy(engine: Engine) -> None:
    greedy = _gen(engine, temperature=0)
    assert _gen(engine, temperature=1.0, top_p=1e-6)["output_ids"] == greedy["output_ids"]
    assert _gen(engine, temperature=1.0, min_p=1.0)["output_ids"] == greedy["output_ids"]


def test_unseeded_sampling_varies(engine: Engine) -> None:
    outs = {tuple(_gen(engine, temperature=2.0)["output_ids"]) for _ in range(4)}
    assert len(outs) > 1


def test_max_new_tokens_gives_length(engine: Engine) -> None:
    out = engine.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["completion_tokens"] == 5


def test_stop_string_cuts_text_and_reports_match(engine: Engine) -> None:
    full = _gen(engine, temperature=0)["text"]
    assert len(full) > 6
    stop = full[3:5]
    first = full.find(stop)
    out = _gen(engine, temperature=0, stop=[stop, "never-appears"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:first]
    kept = _gen(engine, temperature=0, stop=stop, no_stop_trim=True)
    assert kept["text"] == full[: first + len(stop)]


def test_stop_token_ids(engine: Engine) -> None:
    ids = _gen(engine, temperature=0)["output_ids"]
    target = ids[4]
    out = _gen(engine, temperature=0, stop_token_ids=[target])
    assert out["output_ids"] == ids[: ids.index(target) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


def test_min_new_tokens_defers_stop_tokens(engine: Engine) -> None:
    ids = _gen(engine, temperature=0)["output_ids"]
    eos_engine_ids = engine.core.eos_token_ids
    assert eos_engine_ids == (0,)
    # Make some generated token act as EOS via stop_token_ids and check min_new_tokens defers it.
    target = ids[2]
    out = _gen(engine, temperature=0, stop_token_ids=[target], min_new_tokens=10)
    assert len(out["output_ids"]) >= 10
    assert target not in out["output_ids"][:10]


def test_n_returns_distinct_completions(engine: Engine) -> None:
    outs = engine.generate(
        PROMPT, {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.5, "n": 3}
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_seeded_n_choices_are_reproducible_and_distinct(engine: Engine) -> None:
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.0, "n": 3, "seed": 11}
    first = engine.generate(PROMPT, dict(params))
    again = engine.generate(PROMPT, dict(params))
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in first}) == 3


def test_penalties_change_greedy_output(engine: Engine) -> None:
    base = _gen(engine, temperature=0)["output_ids"]
    rep = _gen(engine, temperature=0, repetition_penalty=5.0)["output_ids"]
    freq = _gen(engine, temperature=0, frequency_penalty=2.0)["output_ids"]
    pres = _gen(engine, temperature=0, presence_penalty=2.0)["output_ids"]
    assert len(set(base)) < len(base), "the tiny model repeats itself without penalties"
    assert rep != base and freq != base and pres != base
    # A strong presence penalty discourages reuse: more distinct tokens than greedy.
    assert len(set(pres)) > len(set(base))


def test_streamed_logprobs_say_how_many_they_hold(engine: Engine) -> None:
    """Each streamed chunk's lists are cumulative, and ``output_token_logprobs_length`` says
    so, as the server's do: SGLang's frontend trims by it (without it, it summed the lists)."""
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    chunks = list(engine.generate(PROMPT, params, return_logprob=True, stream=True))
    assert chunks
    for chunk in chunks:
        meta = chunk["meta_info"]
        n = meta["completion_tokens"]
        assert meta["output_token_logprobs_length"] == n == len(meta["output_token_logprobs"])
    assert chunks[-1]["meta_info"]["output_token_logprobs_length"] == 6


def test_logprobs_with_top_k(engine: Engine) -> None:
    out = engine.generate(
        PROMPT,
        {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    for (lp, tid, _), top in zip(lps, meta["output_top_logprobs"], strict=True):
        assert lp <= 0.0
        assert len(top) == 3
        assert top[0][1] == tid  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(lp, abs=1e-5)
        assert top[0][0] >= top[1][0] >= top[2][0]


def test_streaming_yields_cumulative_text(engine: Engine) -> None:
    full = _gen(engine, temperature=0)
    chunks = list(
        engine.generate(
            PROMPT, {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}, stream=True
        )
    )
    assert len(chunks) > 2
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_max_new_tokens_zero_prefills_only(engine: Engine) -> None:
    out = engine.generate(PROMPT, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_input_logprobs_match_teacher_forced_scores(engine: Engine, tiny_llama_dir: Path) -> None:
    """Prefill-only scoring (what the frontend's select() uses) equals HF's log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})  # cache the prompt
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None
    assert entries[3][2] == engine.tokenizer.decode([ids[3]], skip_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-4)
    # from a start position, with generation: only later prompt positions are scored
    start = 4
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[start:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        expected[start - 1 :], abs=1e-4
    )
    assert len(meta["input_top_logprobs"]) == len(ids) - start
    assert len(meta["output_token_logprobs"]) == 2
