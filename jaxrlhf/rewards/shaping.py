"""Host-side shaping of a rollout's scores: DAPO's overlong penalty, normalisation and
clipping."""

from __future__ import annotations

import numpy as np


def overlong_penalty(
    lengths: np.ndarray, stopped: np.ndarray, max_new_tokens: int, buffer: int, penalty: float
) -> np.ndarray:
    """DAPO's soft overlong punishment ``[N]`` (to subtract from the scores).

    Responses longer than ``max_new_tokens - buffer`` pay linearly up to ``penalty`` at the
    budget; responses cut off at the budget (no stop token) pay ``penalty`` in full.
    """
    if buffer <= 0 or penalty <= 0:
        return np.zeros(len(lengths), np.float32)
    over = np.clip((lengths - (max_new_tokens - buffer)) / buffer, 0.0, 1.0)
    return (np.where(stopped, over, 1.0) * penalty).astype(np.float32)


def shape_scores(scores: np.ndarray, *, normalize: bool, clip: float | None) -> np.ndarray:
    """``[N]`` scores whitened over the batch (``normalize``: mean 0, std 1, eps 1e-6) and
    then clipped to ``[-clip, clip]`` (None: no clipping); float32."""
    if normalize:
        scores = (scores - scores.mean()) / (scores.std() + 1e-6)
    if clip is not None:
        scores = np.clip(scores, -clip, clip)
    return scores.astype(np.float32)
