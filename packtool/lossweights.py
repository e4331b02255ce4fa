"""How much each target token weighs in the step: the loss modes, and the weights of one pack's tokens.

A sample ``i`` of a pack has its loss weight ``w_i`` (its ``loss_weight`` in the source, times its mixture dataset's
factor; 1 by default) and ``n_i`` target tokens (the positions that predict a target: what a trainer's loss counts).
Under a loss mode each target token of sample ``i`` weighs:

* ``token``: ``w_i`` (every target token the same where no weight is given: the trainer's per-token mean);
* ``sample``: ``w_i / n_i`` (each sample sums to ``w_i``: the per-sample, per-conversation mean);
* ``square``: ``w_i / sqrt(n_i)`` (the square averaging some VLM recipes use, between the two).

The trainer divides the sum of ``weight x token loss`` over a global batch (every micro-batch of the step, every
data-parallel rank) by the sum of the weights over the same tokens. Packed so, a sample's weight never depends on
the samples it was packed with. Numpy only: both the reader and ``stats`` use it.
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

LossMode = Literal["token", "sample", "square"]
#: The loss modes, the default first.
LOSS_MODES: tuple[str, ...] = get_args(LossMode)


def check_loss_mode(mode: str) -> LossMode:
    """``mode`` if it is one of :data:`LOSS_MODES`; else a one-line :class:`ValueError`."""
    if mode not in LOSS_MODES:
        raise ValueError(f"loss_mode must be one of {', '.join(LOSS_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def token_scale(weights: np.ndarray, counts: np.ndarray, mode: str) -> np.ndarray:
    """Each sample's weight per target token (float64) under ``mode``: ``weights`` ``w_i``, ``counts`` ``n_i``
    (a sample without target tokens gets 0)."""
    w = np.asarray(weights, np.float64)
    n = np.asarray(counts, np.float64)
    check_loss_mode(mode)
    if mode == "token":
        return w.copy()
    safe = np.where(n > 0, n, 1.0)
    scale = w / safe if mode == "sample" else w / np.sqrt(safe)
    return np.where(n > 0, scale, 0.0)


def sample_totals(weights: np.ndarray, counts: np.ndarray, mode: str) -> np.ndarray:
    """Each sample's whole weight in the step under ``mode`` (its tokens' weights summed, float64): ``w_i n_i``,
    ``w_i`` or ``w_i sqrt(n_i)``."""
    return token_scale(weights, counts, mode) * np.asarray(counts, np.float64)
