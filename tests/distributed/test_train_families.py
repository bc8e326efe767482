"""Training beyond Llama: each family's steps equal HF transformers' own training (losses and
gradient norms at every step, weights after three; the tolerances of test_train.py).

Qwen3: the per-head q/k norm weights are one vector each, applied to every head; their gradients
are summed over the heads of a rank (autograd) and over the tp ranks (the copy region's backward).
"""

from __future__ import annotations

import pytest
from test_train import OPTIM, check_against_hf, hf_training

from harness.multirank import run_ranks
from harness.rankfns import train_steps


@pytest.fixture(scope="module")
def qwen3_run(tiny):
    return hf_training(str(tiny("qwen3").path))


@pytest.mark.parametrize("dp,tp,zero", [(1, 1, 0), (1, 2, 1), (2, 2, 3)], ids=lambda v: str(v))
def test_qwen3_trains_as_hf(qwen3_run, dp, tp, zero):
    path, batches = qwen3_run[:2]
    check_against_hf(run_ranks(dp * tp, train_steps, path, batches, dp, tp, zero, **OPTIM), qwen3_run)
