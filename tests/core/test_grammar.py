"""core/grammar.py engine-free: the batch bitmask (rows masked, allocated once, verify chains),
what a sampled token does to a request's matcher (dead ends and rejections abort it, a
terminated grammar stops it) and jump-forward, on a real tokenizer (a tiny BPE one) and a
matcher that accepts one fixed token sequence."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tiny_models import make_tokenizer_json
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from radixserve.core.grammar import NO_TOKEN, GrammarMasker, GrammarStepper, mark_dead_rows
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.request import FinishReason, Req, SamplingParams
from radixserve.core.tokenizer import Tokenizer

VOCAB = 40  # two bitmask words, the second partly used


class Sequence(Grammar):
    """Accepts exactly ``tokens`` (then terminates); ``forced`` is its forced string."""

    def __init__(self, tokens: list[int], forced: str = "") -> None:
        self.tokens, self.forced, self.pos = tokens, forced, 0

    def accept_token(self, token_id: int) -> bool:
        if self.pos < len(self.tokens) and self.tokens[self.pos] == token_id:
            self.pos += 1
            return True
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(0)
        if self.pos < len(self.tokens):
            t = self.tokens[self.pos]
            bitmask[index, t // 32] = 1 << (t % 32)

    def is_terminated(self) -> bool:
        return self.pos == len(self.tokens)

    def rollback(self, num_tokens: int) -> None:
        self.pos -= num_tokens

    def forced_string(self) -> str:
        return self.forced

    def copy(self) -> Grammar:
        return Sequence(self.tokens, self.forced)


class Backend(GrammarBackend):
    def __init__(self) -> None:
        self.allocated: list[tuple[int, int]] = []
        self.applied: list[list[int]] = []
        self.masks: list[torch.Tensor] = []

    def compile(self, kind: str, spec: str) -> Grammar:
        raise AssertionError("not compiled here")

    def allocate_bitmask(self, rows: int, vocab_size: int) -> torch.Tensor:
        self.allocated.append((rows, vocab_size))
        return super().allocate_bitmask(rows, vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.applied.append(list(rows))
        self.masks.append(bitmask)
        if logits.device.type != "meta":
            super().apply_bitmask(logits, bitmask, rows)


def masker(rows: int = 3, vocab: int = VOCAB) -> tuple[GrammarMasker, Backend, list[int]]:
    backend, made = Backend(), []

    def factory() -> GrammarBackend:
        made.append(1)
        return backend

    return GrammarMasker(factory, rows, vocab), backend, made


def req(grammar: Grammar | None, out: list[int] | None = None, **params: Any) -> Req:
    r = Req("r", [1], SamplingParams(**params))
    r.grammar = grammar
    r.output_ids = list(out or [])
    return r


def allowed(logits: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(row.numel()) if row[t] != -math.inf] for row in logits]


def test_only_constrained_rows_are_masked() -> None:
    m, backend, made = masker()
    assert (m.rows, m.vocab_size) == (3, VOCAB)
    logits = torch.zeros(2, VOCAB)
    assert m.apply(logits, [req(None), req(None)]) is False
    assert made == [] and backend.allocated == [] and allowed(logits)[0] == list(range(VOCAB))
    logits = torch.zeros(3, VOCAB)
    assert m.apply(logits, [req(None), req(Sequence([35, 2])), req(Sequence([4]))]) is True
    assert allowed(logits) == [list(range(VOCAB)), [35], [4]]
    assert backend.allocated == [(3, VOCAB)] and backend.applied == [[1, 2]]
    host = m._host
    logits = torch.zeros(1, VOCAB)
    assert m.apply(logits, [req(Sequence([7]))]) is True
    assert allowed(logits) == [[7]] and m._host is host and backend.allocated == [(3, VOCAB)]
    assert made == [1, 1]


def test_verify_chains_mask_each_draft_position_and_leave_the_matchers() -> None:
    m, backend, made = masker(rows=2)
    logits = torch.zeros(6, VOCAB)
    m.apply_chains(logits, [(0, None, [1, 2])])
    assert made == [] and allowed(logits)[0] == list(range(VOCAB))
    m.apply_chains(logits, [])
    assert made == []
    g = Sequence([3, 33, 5])
    g.accept_token(3)  # one token in: the draft continues from 33
    h = Sequence([9])
    m.apply_chains(logits, [(0, None, [1]), (1, g, [33, 5]), (4, h, [])])
    assert allowed(logits) == [list(range(VOCAB)), [33], [5], [], [9], list(range(VOCAB))]
    assert backend.allocated == [(5, VOCAB)]  # 5 rows reach past the 2 allocated
    assert backend.applied == [[1, 2, 3, 4]]
    assert g.pos == 1 and h.pos == 0  # rolled back
    logits = torch.zeros(4, VOCAB)
    m.apply_chains(logits, [(0, Sequence([6]), [6])])  # 2 rows: the 5-row mask serves
    assert backend.allocated == [(5, VOCAB)] and allowed(logits)[:2] == [[6], []]
    m2, backend2, _ = masker(rows=4)
    m2.apply_chains(torch.zeros(4, VOCAB), [(0, Sequence([6]), [6])])
    assert backend2.allocated == [(4, VOCAB)]  # never fewer rows than the masker's own
    m2.apply(torch.zeros(1, VOCAB), [req(Sequence([1]))])
    assert backend2.allocated == [(4, VOCAB)]
    m2.apply_chains(torch.zeros(4, VOCAB), [(0, Sequence([6, 7, 8]), [6, 7])])  # 3 rows of 4
    assert backend2.allocated == [(4, VOCAB)]
    m2.apply_chains(torch.zeros(4, VOCAB), [(1, Sequence([6, 7, 8]), [6, 7])])  # all 4 rows
    assert backend2.allocated == [(4, VOCAB)]
    with pytest.raises(RuntimeError) as err:
        m2.apply_chains(torch.zeros(4, VOCAB), [(0, Sequence([6, 7]), [6, 8])])
    assert str(err.value) == "a checked draft token 8 broke the grammar"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_json(path / "tokenizer.json")
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )  # a BOS that jump-forward must not add
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def test_a_dead_end_or_a_rejected_token_aborts(tokenizer: Tokenizer) -> None:
    stepper = GrammarStepper(tokenizer)
    r = req(Sequence([5, 6]), [5])
    assert stepper.accept(r, NO_TOKEN) is False
    assert r.finish_reason == FinishReason(
        "abort", message="grammar dead end after 1 output tokens: no token is allowed here"
    )
    r = req(Sequence([5]), [5, 5], min_new_tokens=3)
    assert stepper.accept(r, NO_TOKEN) is False
    assert r.finish_reason.message == (
        "grammar dead end after 2 output tokens: no token is allowed here (only a stop token "
        "was, but min_new_tokens is not reached)"
    )
    r = req(Sequence([5]), [5, 5], min_new_tokens=2)
    stepper.accept(r, NO_TOKEN)
    assert r.finish_reason.message.endswith("no token is allowed here")
    token = tokenizer.token_to_id("<|im_end|>")
    r = req(Sequence([5]), [7, 8, 9])
    assert stepper.accept(r, token) is False
    assert r.finish_reason == FinishReason(
        "abort",
        message=f"the grammar rejected sampled token {token} ('<|im_end|>') after 3 output tokens",
    )
    r = req(Sequence([5]))
    assert stepper.accept(r, 5) is True and r.finish_reason is None and r.grammar.pos == 1


def test_a_terminated_grammar_stops_the_request(tokenizer: Tokenizer) -> None:
    stepper = GrammarStepper(tokenizer)
    r = req(Sequence([5]), [5])
    r.grammar.accept_token(5)
    assert stepper.after_token(r) == []
    assert r.finish_reason == FinishReason("stop", matched=5) and r.finished
    r.output_ids.append(6)
    assert stepper.after_token(r) == [] and r.finish_reason.matched == 5  # finished already


def test_jump_forward_appends_the_forced_tokens_but_the_last(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 3
    stepper = GrammarStepper(tokenizer)
    assert (stepper.jump_forward, stepper.jump_forward_tokens) == (True, 0)
    r = req(Sequence([*ids, 0], forced=text))
    assert stepper.after_token(r) == ids[:-1] and r.grammar.pos == len(ids) - 1
    assert stepper.jump_forward_tokens == len(ids) - 1
    # the budget left caps it
    r = req(Sequence([*ids, 0], forced=text), [9] * 8, max_new_tokens=9)
    assert stepper.forced_tokens(r) == ids[:1] and stepper.jump_forward_tokens == len(ids)
    r = req(Sequence([*ids, 0], forced=text), [9] * 9, max_new_tokens=9)
    assert stepper.forced_tokens(r) == [] and r.grammar.pos == 0
    r = req(Sequence([*ids, 0], forced=text), [9] * 10, max_new_tokens=9)
    assert stepper.forced_tokens(r) == []
    # up to the first token the matcher refuses
    r = req(Sequence([ids[0], 0], forced=text))
    assert stepper.forced_tokens(r) == ids[:1] and r.grammar.pos == 1
    total = stepper.jump_forward_tokens
    # not jumped: off, logprobs asked, finished, nothing forced
    for r, s in [
        (req(Sequence(ids, forced=text)), GrammarStepper(tokenizer, jump_forward=False)),
        (req(Sequence(ids, forced=text), logprobs=True), stepper),
        (req(Sequence(ids, forced="")), stepper),
    ]:
        assert s.after_token(r) == [] and r.grammar.pos == 0
    r = req(Sequence(ids, forced=text))
    r.finish(FinishReason("abort", message="x"))
    assert stepper.forced_tokens(r) == [] and r.grammar.pos == 0
    assert stepper.jump_forward_tokens == total


def test_dead_rows_are_marked_only_where_constrained() -> None:
    logits = torch.zeros(4, 3)
    logits[0] = -math.inf
    logits[1, :2] = -math.inf
    logits[2] = -math.inf
    logits[3] = -math.inf
    ids = [1, 2, 1, 0]
    mark_dead_rows(
        logits, ids, [req(Sequence([1])), req(Sequence([2])), req(None), req(Sequence([0]))]
    )
    assert ids == [NO_TOKEN, 2, 1, NO_TOKEN]
    assert NO_TOKEN == -1


class Copies(torch.overrides.TorchFunctionMode):
    """Records each ``Tensor.copy_``: (destination and source devices, rows, non_blocking)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, int, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args
            self.calls.append(
                (dst.device.type, src.device.type, src.shape[0], kwargs.get("non_blocking"))
            )
        return func(*args, **kwargs)


def test_logits_on_another_device_get_a_mirror_of_the_used_rows() -> None:
    """The host mask's rows up to the last constrained one are copied (asynchronously) into
    one mirror on the logits' device, made once and grown only for longer verify chains
    (logits on the meta device: another device on a CPU-only machine)."""
    m, backend, _ = masker(rows=3)
    logits = torch.zeros(3, VOCAB, device="meta")
    with Copies() as copies:
        m.apply(logits, [req(None), req(Sequence([1])), req(None)])
        m.apply(logits, [req(Sequence([1])), req(None), req(Sequence([1]))])
    assert copies.calls == [("meta", "cpu", 2, True), ("meta", "cpu", 3, True)]
    mirror = backend.masks[0]
    assert mirror.device.type == "meta" and mirror.shape == (3, 2) and mirror.dtype == torch.int32
    assert backend.masks[1] is mirror
    with Copies() as copies:  # two rows: the mirror serves
        m.apply_chains(logits, [(0, Sequence([6]), [6])])
    assert backend.masks[2] is mirror and copies.calls == [("meta", "cpu", 2, True)]
    with Copies() as copies:  # three rows, as many as the mirror's
        m.apply_chains(logits, [(0, Sequence([6, 7]), [6, 7])])
    assert backend.masks[3] is mirror and copies.calls == [("meta", "cpu", 3, True)]
    with Copies() as copies:  # five rows: a larger host mask and mirror
        m.apply_chains(torch.zeros(6, VOCAB, device="meta"), [(1, Sequence([6, 7, 8]), [6, 7, 8])])
    assert copies.calls == [("meta", "cpu", 5, True)]
    assert backend.masks[4].shape == (5, 2) and backend.masks[4].device.type == "meta"
    assert backend.allocated == [(3, VOCAB), (5, VOCAB)]
    wide, backend, _ = masker(rows=3, vocab=200)  # more words a row than rows
    wide.apply(torch.zeros(3, 200, device="meta"), [req(Sequence([1]))])
    wide.apply_chains(torch.zeros(3, 200, device="meta"), [(0, Sequence([6]), [6])])
    assert backend.masks[1] is backend.masks[0] and backend.masks[0].shape == (3, 7)
