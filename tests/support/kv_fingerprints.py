"""KV fingerprints for the tiered cache's tests: a slot's K in layer ``l`` holds
``100 * token + l`` in every element and its V the negative, so a test reads back which
token's KV a device slot holds after any copies between the tiers. Both go through the
device pool as a step does: the loads the cache queued go out first (``prepare_loads``)."""

from __future__ import annotations

import torch

from radixserve.core.hicache import HiRadixCache


def write_fingerprints(cache: HiRadixCache, slots: torch.Tensor, tokens: list[int]) -> None:
    """``tokens``' fingerprints into the device pool at ``slots``, every layer."""
    dev = cache.host.device_pool
    dev.prepare_loads(per_layer=False)
    for layer in range(len(dev.k)):
        for slot, token in zip(slots.tolist(), tokens, strict=True):
            dev.k[layer][slot] = float(100 * token + layer)
            dev.v[layer][slot] = float(-100 * token - layer)


def kv_tokens(cache: HiRadixCache, slots: torch.Tensor) -> list[int]:
    """The tokens whose fingerprints the device slots hold (every layer, K and V checked)."""
    dev = cache.host.device_pool
    dev.prepare_loads(per_layer=False)
    out = []
    for slot in slots.tolist():
        token = int(dev.k[0][slot, 0, 0].item()) // 100
        for layer in range(len(dev.k)):
            assert dev.k[layer][slot].eq(100.0 * token + layer).all()
            assert dev.v[layer][slot].eq(-100.0 * token - layer).all()
        out.append(token)
    return out
