"""Qwen2.5-VL's window attention: the order of the merged blocks and the windows' lengths equal
transformers' (``get_vision_window_index``) for grids with whole and cut windows and several
images at once, and the tiny test model (tests/support/tiny_vlm.py) really has several windows
per image and both kinds of blocks."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import QWEN2_5_VL_VISION

from radixserve.plugins.models.qwen2_5_vl import WindowedVisionTower, window_order

GRIDS = [
    [(1, 16, 16)],  # 8x8 merged blocks, whole 4x4 windows
    [(1, 10, 8)],  # 5x4: the last row of windows cut
    [(1, 22, 14), (1, 8, 8), (1, 4, 30)],  # several images, cuts on both edges
    [(2, 12, 10)],  # two frames
]


@pytest.mark.parametrize("grids", GRIDS)
def test_window_order_equals_transformers(grids: list[tuple[int, int, int]]) -> None:
    from transformers.vision_utils import get_vision_window_index

    # 112-pixel windows of 14-pixel patches merged 2x2: 4x4 merged blocks a window
    theirs, cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=112, patch_size=14
    )
    order, lengths = window_order(grids, merge=2, window=4)
    assert order.tolist() == theirs.tolist()
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == cu.tolist()


def test_tiny_model_has_several_windows_and_both_kinds_of_blocks() -> None:
    tower = WindowedVisionTower(QWEN2_5_VL_VISION)
    assert tower.window == 2
    assert tower.full_blocks == {1} and len(tower.blocks) == 3
    # the engine tests' image sizes (in patches of 4 pixels, after the processor's resize)
    _, lengths = window_order([(1, 8, 8), (1, 10, 8)], tower.merge, tower.window)
    assert lengths == [16] * 4 + [16, 16, 16, 16, 8, 8]
