"""The fused all-reduce + add + RMSNorm kernel (plugins/hardware/allreduce_norm.py) in one
process: alone (one rank) it equals the Triton add + RMSNorm the model runs after an
all-reduce (fused_ops.add_rms_norm); as rank 0 or 1 of two, with the peer's
half played by hand (its row already in its slot, its flags already raised), it sums the two
rows in rank order, leaves this rank's rows where the peer reads them (its own buffer, or
pushed into the peer's), raises the peer's flags and
lowers its own (so the next call, or a graph replay, starts from zero flags).

On a CPU machine it runs under TRITON_INTERPRET=1 (int64 addresses of host tensors stand for
the ranks' mapped buffers); on a CUDA machine compiled, on one GPU's memory."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.hardware.allreduce_norm import (  # noqa: E402
    allreduce_add_rms_norm,
    lamport_add_rms_norm,
)
from radixserve.plugins.models.fused_ops import add_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, N = 3, 96
SLOT = ROWS * N  # elements of one call site's slot in these tests


def _addresses(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_equals_the_add_rms_norm_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, residual = (torch.randn(ROWS, N, device=DEVICE).to(dtype) for _ in range(2))
    weight = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    data = torch.zeros(2 * SLOT, dtype=dtype, device=DEVICE)
    flags = torch.zeros(2 * ROWS, dtype=torch.int32, device=DEVICE)
    out, total = allreduce_add_rms_norm(
        x, residual, weight, 1e-6, _addresses(data), _addresses(flags), 0, 1, SLOT, ROWS
    )
    want_out, want_total = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total) and torch.equal(out, want_out)
    assert torch.equal(data[SLOT:].view(ROWS, N), x) and not data[:SLOT].any()  # site 1's slot


def _as_peer_left_it(
    data: list[torch.Tensor], rows: torch.Tensor, rank: int, peer: int, site: int, push: bool
) -> None:
    """Put the peer's rows where its half of the kernel leaves them for ``rank``: in its own
    buffer (pull) or in ours at its slot (push); a site is 2 slots of SLOT elements."""
    base = site * 2 * SLOT
    if push:
        data[rank][base + peer * SLOT : base + (peer + 1) * SLOT] = rows.flatten()
    else:
        data[peer][base : base + SLOT] = rows.flatten()


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("rank", [0, 1])
def test_two_ranks_sum_in_rank_order_and_leave_the_flags_at_rest(rank: int, push: bool) -> None:
    torch.manual_seed(1)
    # float32: Triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to
    # nearest, so only float32 sums compare exactly on both
    dtype = torch.float32
    parts = [torch.randn(ROWS, N, device=DEVICE).to(dtype) for _ in range(2)]
    residual = torch.randn(ROWS, N, device=DEVICE).to(dtype)
    weight = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    peer = 1 - rank
    data = [torch.zeros(4 * SLOT, dtype=dtype, device=DEVICE) for _ in range(2)]
    flags = [torch.zeros(2 * ROWS * 2, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    _as_peer_left_it(data, parts[peer], rank, peer, 0, push)  # the peer left its rows ...
    mine = flags[rank].view(2, ROWS, 2)
    mine[0, :, peer] = 1  # ... and raised its flag for each row in ours
    out, total = allreduce_add_rms_norm(
        parts[rank], residual, weight, 1e-6, _addresses(*data), _addresses(*flags),
        rank, 2, 0, 0, push=push,
    )  # fmt: skip
    summed = parts[0] + parts[1]  # an all-reduce's output, then add + RMSNorm as before
    want_out, want_total = add_rms_norm(summed, residual, weight, 1e-6)
    assert torch.equal(total, want_total) and torch.equal(out, want_out)
    # our rows went where the peer reads them: our buffer (pull) or the peer's, at our slot
    where = data[peer][rank * SLOT : (rank + 1) * SLOT] if push else data[rank][:SLOT]
    assert torch.equal(where.view(ROWS, N), parts[rank])
    assert not data[rank][2 * SLOT :].any() and not data[peer][2 * SLOT :].any()  # site 1
    assert not mine.any()  # our flags: lowered
    theirs = flags[peer].view(2, ROWS, 2)
    assert theirs[0, :, rank].eq(1).all() and theirs.sum() == ROWS  # the peer's: raised, site 0


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_the_ranks_get_identical_results(push: bool) -> None:
    """Rank 0 and rank 1 see each other's rows from opposite sides; the sums are the same
    bits (float32 in rank order), so the ranks' residual streams never drift apart."""
    torch.manual_seed(2)
    dtype = torch.bfloat16
    parts = [torch.randn(ROWS, N, device=DEVICE).to(dtype) * 3 for _ in range(2)]
    residual = torch.randn(ROWS, N, device=DEVICE).to(dtype)
    weight = torch.ones(N, device=DEVICE, dtype=dtype)
    results = []
    for rank in (0, 1):
        peer = 1 - rank
        data = [torch.zeros(4 * SLOT, dtype=dtype, device=DEVICE) for _ in range(2)]
        flags = [torch.zeros(2 * ROWS * 2, dtype=torch.int32, device=DEVICE) for _ in range(2)]
        _as_peer_left_it(data, parts[peer], rank, peer, 1, push)  # site 1 this time
        flags[rank].view(2, ROWS, 2)[1, :, peer] = 1
        results.append(allreduce_add_rms_norm(
            parts[rank], residual, weight, 1e-6, _addresses(*data), _addresses(*flags),
            rank, 2, 2 * SLOT, 2 * ROWS, push=push,
        ))  # fmt: skip
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_peer_that_never_answers_gives_nan_within_the_spin_limit() -> None:
    """The start-up self-test's guard: with a spin limit, a barrier the peer never joins ends
    with NaN results instead of a kernel that never returns."""
    dtype = torch.float32
    x = torch.ones(ROWS, N, device=DEVICE)
    data = [torch.zeros(4 * SLOT, dtype=dtype, device=DEVICE) for _ in range(2)]
    flags = [torch.zeros(2 * ROWS * 2, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    out, total = allreduce_add_rms_norm(
        x, torch.zeros_like(x), torch.ones(N, device=DEVICE), 1e-6, _addresses(*data),
        _addresses(*flags), 0, 2, 0, 0, spin_limit=5,
    )  # fmt: skip
    assert total.isnan().all() and out.isnan().all()


# ---- the flagless (Lamport) variant ----------------------------------------------------------

SENT = torch.tensor(-0.0, dtype=torch.bfloat16)


def _lamport_buffers(max_rows: int) -> list[torch.Tensor]:
    """Two ranks' receive buffers [3 stages, 2 slots, max_rows, N], every element the mark."""
    return [torch.full((3, 2, max_rows, N), -0.0, dtype=torch.bfloat16, device=DEVICE)
            for _ in range(2)]  # fmt: skip


@pytest.mark.parametrize("rank", [0, 1])
def test_lamport_sums_the_rows_that_landed_and_clears_the_last_stage(rank: int) -> None:
    # small integers: every sum is exact in bfloat16 (the interpreter truncates where the GPU
    # rounds), so the reference is the all-reduce's exact sum then add_rms_norm
    torch.manual_seed(3)
    dtype = torch.bfloat16
    parts = [torch.randint(-8, 8, (ROWS, N), device=DEVICE).to(dtype) for _ in range(2)]
    parts[rank][0, 0] = -0.0  # sent as +0.0: the peer never waits on it
    residual = torch.randint(-8, 8, (ROWS, N), device=DEVICE).to(dtype)
    weight = torch.ones(N, device=DEVICE, dtype=dtype)
    peer, max_rows = 1 - rank, ROWS + 1
    bufs = _lamport_buffers(max_rows)
    counters = torch.full((max_rows,), 4, dtype=torch.int32, device=DEVICE)  # call 4: stage 1
    bufs[rank][1, peer, :ROWS] = parts[peer]  # the peer's rows landed in our stage 1
    bufs[rank][0, peer, :ROWS] = 7.0  # what the call before left (stage 0): to be cleared
    out, total = lamport_add_rms_norm(
        parts[rank], residual, weight, 1e-6, _addresses(*bufs), counters, rank, 2, max_rows
    )
    want_out, want_total = add_rms_norm(parts[0] + parts[1], residual, weight, 1e-6)
    assert torch.equal(total, want_total) and torch.equal(out, want_out)
    sent = bufs[peer][1, rank, :ROWS]  # our rows, in the peer's stage 1, our slot
    assert torch.equal(sent, parts[rank]) and sent[0, 0].item() == 0.0
    assert not torch.signbit(sent[0, 0])  # +0.0, not the mark
    stage0 = bufs[rank][0, peer, :ROWS]
    assert torch.equal(stage0.view(torch.int16), torch.full_like(stage0, -0.0).view(torch.int16))
    assert counters[:ROWS].eq(5).all() and counters[ROWS] == 4  # rows not in the call: as were


def test_lamport_gives_nan_when_the_peer_never_sends() -> None:
    x = torch.ones(ROWS, N, device=DEVICE, dtype=torch.bfloat16)
    counters = torch.zeros(ROWS, dtype=torch.int32, device=DEVICE)
    bufs = _lamport_buffers(ROWS)  # nothing lands in them
    out, total = lamport_add_rms_norm(
        x, torch.zeros_like(x), torch.ones_like(x[0]), 1e-6, _addresses(*bufs), counters, 0, 2,
        ROWS, spin_limit=5,
    )  # fmt: skip
    assert total.float().isnan().all() and out.float().isnan().all()
