"""The logits filters behind temperature / top-k / top-p / min-p sampling."""

import torch

from matrixinfer.engine.sampler import filter_logits

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def kept(logits):
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_k_best():
    assert kept(filter_logits(LOGITS, 1.0, 2, 1.0, 0.0)) == [0, 1]


def test_top_p_keeps_smallest_set_reaching_p():
    assert kept(filter_logits(LOGITS, 1.0, -1, 0.7, 0.0)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, -1, 0.75, 0.0)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, -1, 0.76, 0.0)) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, 1.0, -1, 0.3, 0.0)) == [0]


def test_min_p_is_relative_to_the_top_probability():
    assert kept(filter_logits(LOGITS, 1.0, -1, 1.0, 0.3)) == [0, 1, 2]  # 0.15 >= 0.3 * 0.5
    assert kept(filter_logits(LOGITS, 1.0, -1, 1.0, 0.31)) == [0, 1]


def test_temperature_sharpens():
    p1 = filter_logits(LOGITS, 1.0, -1, 1.0, 0.0).softmax(-1)
    p_low = filter_logits(LOGITS, 0.5, -1, 1.0, 0.0).softmax(-1)
    assert p_low[0] > p1[0]
