"""The ``triton`` backend in deterministic mode (``set_batch_invariant``), under
TRITON_INTERPRET=1 on a CPU machine: a token's attention output is bit-identical whether its
sequence came as one prefill, as a cached prefix plus an extend, or token by token as decodes
beside another request; without the mode the decode rows (split-K kernel) differ."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from paged_steps import shuffled_allocator, step_batch  # noqa: E402

from radixserve.core.config import ModelConfig  # noqa: E402
from radixserve.core.memory import KVPool, ReqToTokenPool  # noqa: E402
from radixserve.plugins.attention.triton.backend import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4 * 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
)
# a GPU's decode kernel reads 128 keys a block: a sequence of several blocks, so that its
# splits really divide the keys (the interpreter's blocks are 16 keys)
LEN = 40 if DEVICE == "cpu" else 300
g = torch.Generator().manual_seed(0)
Q = torch.randn(LEN, 4, 16, generator=g)
K = torch.randn(LEN, 2, 16, generator=g)
V = torch.randn(LEN, 2, 16, generator=g)
OTHER = torch.randn(3, LEN, 4, 16, generator=g)  # another request's q, k and v (sliced)


def _run(steps: list[tuple[int, int, bool]], invariant: bool) -> torch.Tensor:
    """Request 1's sequence over ``steps`` of (its new tokens, request 2's new tokens, whether
    request 1 decodes); its attention output at every position."""
    pool = KVPool(2 * LEN + 64, 1, 2, 16, torch.float32, DEVICE)
    backend = TritonAttention(pool, CONFIG, DEVICE)
    if invariant:
        backend.set_batch_invariant()
    alloc, table = shuffled_allocator(2 * LEN + 64, 1), ReqToTokenPool(4, LEN + 24)
    out, done, other_done = [], 0, 0
    for new, other_new, decode in steps:
        rows, cached, counts = [1], [done], [new]
        if other_new:
            rows, cached, counts = [1, 2], [done, other_done], [new, other_new]
        batch = step_batch(table, alloc, rows, cached, counts, 1 if decode else 0, DEVICE)
        mine = slice(done, done + new)
        theirs = slice(other_done, other_done + other_new)
        q = torch.cat([Q[mine], OTHER[0][theirs]]).to(DEVICE)
        k = torch.cat([K[mine], OTHER[1][theirs, :2]]).to(DEVICE)
        v = torch.cat([V[mine], OTHER[2][theirs, :2]]).to(DEVICE)
        backend.prepare(batch)
        out.append(backend.forward(q, k, v, 0, batch)[:new].cpu())
        done, other_done = done + new, other_done + other_new
    return torch.cat(out)


ONE_PREFILL = [(LEN, 0, False)]
CACHED_PREFIX = [(25, 0, False), (LEN - 25, 7, False)]
DECODES = [(LEN - 10, 0, False)] + [(1, 3 if i % 2 else 0, True) for i in range(10)]


def test_every_layout_gives_the_same_bits() -> None:
    ref = _run(ONE_PREFILL, invariant=True)
    assert torch.equal(_run(CACHED_PREFIX, invariant=True), ref)
    assert torch.equal(_run(DECODES, invariant=True), ref)


def test_without_the_mode_decode_rows_differ() -> None:
    ref = _run(ONE_PREFILL, invariant=False)
    assert not torch.equal(_run(DECODES, invariant=False), ref)
