"""ForwardBatch: everything one model step needs, built once per step by the ModelRunner.

Layout: the new tokens of all requests are flattened into one sequence, decodes first (one
token each), then prefill chunks. ``seq_lens`` counts each request's tokens after this step
(cached prefix + new); attention reads KV slots from ``req_to_token[req_pool_indices]`` on the
host, or from ``req_to_token_pool.device_table(device)`` on a device (kept in sync by the pool;
never keep a private copy of the table across steps).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

# NOTE: to_device is re-exported here, where callers have always imported it from; it lives in
# memory.py so that memory.py needs nothing of this module (no import cycle).
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.memory import to_device as to_device


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens
    positions: torch.Tensor  # [T] position of each new token in its sequence
    out_cache_loc: torch.Tensor  # [T] KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] row of each request in the req->token table
    req_to_token: torch.Tensor  # [max_requests, max_context] the host table itself
    seq_lens: list[int]  # [B] tokens in the sequence after this step
    extend_lens: list[int]  # [B] new tokens this step
    num_decode: int  # the first num_decode requests have extend_len == 1
    logits_indices: torch.Tensor  # rows of the flattened sequence whose logits are needed
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool  # owns the table and its device mirror
    # Layers whose output (the residual stream after the layer, HF's hidden_states[i + 1]) the
    # model keeps for every new token in ``hidden_states`` (draft heads read them).
    capture_hidden_layers: tuple[int, ...] = ()
    hidden_states: dict[int, torch.Tensor] | None = None
    # Set by a step executor whose CUDA graph already ran the speculative plugin's
    # ``target_hidden`` on this forward's hidden states (it must not run again).
    hidden_consumed: bool = False
    # Rows whose final hidden state (after the model's last norm) the model keeps in
    # ``final_hidden`` (embedding requests pool them; see core/pooling.py).
    hidden_rows: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None
    # Pipeline parallelism: the residual stream [T, hidden] the previous stage sent (a later
    # stage's model starts from it instead of embedding ``input_ids``).
    stage_input: torch.Tensor | None = None
    # A vision-language model's step: core.multimodal.StepImages (image rows and embeddings,
    # M-RoPE positions), set by core/multimodal_strategy.py; None on a text-only step.
    mm: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def prepare_from_device(
    attention: Any,
    batch: ForwardBatch,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int | None = None,
) -> ForwardBatch:
    """Prepare ``attention`` for a batch whose request rows and sequence lengths (after the
    step) are device tensors: one decode per request (``q_len`` None), or ``q_len`` verify
    rows per request, each attending as a decode that ends at itself. A backend that prepares
    from device tensors (``prepare_decode_graph`` / ``prepare_verify_graph``, declared by its
    ``prepares_decode_on_device`` / ``prepares_verify_on_device``: capturable in a CUDA
    graph) does; any other gets ``prepare`` on ``batch`` with the host lists read from the
    tensors, which waits for them (synchronous devices: the CPU). Returns the batch to forward.
    """
    if q_len is None and attention.prepares_decode_on_device:
        attention.prepare_decode_graph(rows, seq_lens)
        return batch
    if q_len is not None and attention.prepares_verify_on_device:
        attention.prepare_verify_graph(rows, seq_lens, q_len)
        return batch
    bs = rows.shape[0]
    new = 1 if q_len is None else q_len
    host = replace(
        batch,
        req_pool_indices=rows.cpu().long(),
        seq_lens=seq_lens.tolist(),
        extend_lens=[new] * bs,
        num_decode=bs if q_len is None else 0,
    )
    attention.prepare(host)
    return host
