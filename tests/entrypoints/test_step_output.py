"""The output path between the engine and HTTP processes, without either process: what the
engine's StepOutputBuilder gathers, encoded and decoded as on the socket, rebuilds in the
TokenizerManager exactly the engine's view of every request, step after step (appends, a stop
string that cuts text already sent, logprobs, changed counts, finishes), and a step's message
holds only what changed."""

from __future__ import annotations

import asyncio
import random
import types

from radixserve.core.request import FinishReason, Req, SamplingParams
from radixserve.entrypoints import ipc
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.step_output import StepOutputBuilder
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


def manager() -> TokenizerManager:
    client = types.SimpleNamespace(on_step=None, on_death=None, dead=None)
    ready = types.SimpleNamespace(
        vocab_size=100, speculative=None, lora_adapters=None, model_dir=""
    )
    return TokenizerManager(client, ready, tokenizer=None)  # type: ignore[arg-type]


def request(rid: str, logprobs: bool = False) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=1000, logprobs=logprobs))
    req.detok = types.SimpleNamespace(text="")  # type: ignore[assignment]
    return req


def ship(builder: StepOutputBuilder, tm: TokenizerManager, changed: list[Req]) -> ipc.StepOutput:
    for req in changed:
        builder.add(req)
    out = builder.take()
    assert out is not None and builder.take() is None  # taken once, then empty
    received = ipc.decode_outbound(ipc.encode(out))
    assert isinstance(received, ipc.StepOutput)
    tm._on_step(received)
    return received


def follow(tm: TokenizerManager, reqs: list[Req]) -> list[ServerReq]:
    event = asyncio.Event()
    views = [ServerReq(r.rid, r.input_ids, r.sampling, event) for r in reqs]
    tm.reqs.update((v.rid, v) for v in views)
    return views


def test_random_steps_rebuild_every_request_exactly() -> None:
    rng = random.Random(7)
    tm, builder = manager(), StepOutputBuilder()
    reqs = [request(f"r{i}", logprobs=i % 3 == 0) for i in range(24)]
    views = follow(tm, reqs)
    for _ in range(60):
        live = [r for r in reqs if not r.finished]
        changed = rng.sample(live, k=rng.randint(1, len(live))) if live else []
        for req in changed:
            for _ in range(rng.choice((0, 1, 1, 1, 3))):  # none: a step that only finishes
                req.output_ids.append(rng.randrange(100))
                if req.sampling.logprobs:
                    req.output_logprobs.append(-rng.random())
                    req.output_top_logprobs.append([])
                req.detok.text += rng.choice(("", "a", "bc", "é "))  # type: ignore[union-attr]
            if rng.random() < 0.1:  # a stop string cuts text that may have been sent
                text = req.detok.text  # type: ignore[union-attr]
                req.detok.text = text[: rng.randrange(len(text) + 1)]  # type: ignore[union-attr]
            if rng.random() < 0.05:
                req.cached_tokens = rng.randrange(1, 50)
            if rng.random() < 0.1:
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += rng.randrange(3)
            if rng.random() < 0.03:
                req.finish(FinishReason("stop", matched="x"))
        if changed:
            ship(builder, tm, changed)
        for req, view in zip(reqs, views, strict=True):
            assert view.output_ids == req.output_ids
            assert view.text == req.detok.text  # type: ignore[union-attr]
            assert view.logprobs == req.output_logprobs
            assert (view.cached_tokens, view.spec_verify_ct, view.spec_accepted_tokens) == (
                req.cached_tokens,
                req.spec_verify_ct,
                req.spec_accepted_tokens,
            )
            assert view.finished == req.finished
    assert any(r.finished for r in reqs) and any(not r.finished for r in reqs)
    finished = {r.rid for r in reqs if r.finished}
    assert finished.isdisjoint(tm.reqs) and finished.isdisjoint(builder._sent)


def test_a_plain_decode_step_carries_only_tokens_and_text() -> None:
    tm, builder = manager(), StepOutputBuilder()
    reqs = [request("a"), request("b")]
    follow(tm, reqs)
    for req in reqs:
        req.cached_tokens = 2
        req.output_ids.append(5)
        req.detok.text = "x"  # type: ignore[union-attr]
    first = ship(builder, tm, reqs)
    assert [x.cached_tokens for x in first.extras.values()] == [2, 2]  # new: sent once
    for req in reqs:
        req.output_ids += [6, 7]
        req.detok.text += "yz"  # type: ignore[union-attr]
    second = ship(builder, tm, reqs)
    assert second.extras == {}
    assert (second.rids, second.num_tokens, second.token_ids, second.text_deltas) == (
        ["a", "b"],
        [2, 2],
        [6, 7, 6, 7],
        ["yz", "yz"],
    )


def test_a_refused_request_finishes_with_its_status() -> None:
    tm, builder = manager(), StepOutputBuilder()
    req = request("bad")
    (view,) = follow(tm, [req])
    req.finish(FinishReason("abort", message="no"))
    builder.add(req, error_status=400)
    out = builder.take()
    assert out is not None
    tm._on_step(ipc.decode_outbound(ipc.encode(out)))  # type: ignore[arg-type]
    assert view.finished and view.error_status == 400 and view.finish.message == "no"  # type: ignore[union-attr]
    assert "bad" not in tm.reqs
