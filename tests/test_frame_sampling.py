"""Qwen2-VL's frame sampling (``Qwen2VLVideoProcessor.sample_frames``: ``torch.arange(0, total, total / n).int()``)
is computed without torch; it equals torch's own result for every frame count up to 2,000 and every count of
frames to sample that the rule can ask for (the oracle is torch itself)."""

from __future__ import annotations

import torch

from packtool.families.qwen2_vl.family import frame_steps


def test_frame_steps_equal_torchs_arange():
    cases = 0
    for total in range(1, 2001):
        wanted = {2, 4, 6, 8, 16, 32, 64, 768, total // 2 * 2, total // 3 // 2 * 2, *range(2, min(total, 80) + 1, 2)}
        for n in sorted(k for k in wanted if 0 < k <= total):
            expected = tuple(torch.arange(0, total, total / n).int().tolist())
            assert frame_steps(total, n) == expected, (total, n)
            assert frame_steps(total, float(n)) == expected, (total, n)  # the rule's count may be a float
            cases += 1
    assert cases > 50_000


def test_a_control_that_rounds_instead_of_truncating_differs():
    import numpy as np

    def rounded(total: int, n: int) -> tuple[int, ...]:
        return tuple(int(v) for v in np.round(np.arange(0, total, total / n)))

    assert any(rounded(t, n) != tuple(torch.arange(0, t, t / n).int().tolist())
               for t in range(3, 200) for n in range(2, t, 2))
