"""The sampler: logits filters, penalties, logit bias, min_tokens, seeded reproducibility."""

import torch

from matrixinfer.worker.sampler import SamplingRow, filter_logits, sample
from matrixinfer.engine.sampling_params import SamplingParams

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


def test_per_row_parameters_filter_each_row_on_its_own():
    rows = LOGITS.expand(3, 4)
    out = filter_logits(rows, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1, -1, 3]),
                        torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0.0, 0.0, 0.0]))
    assert [kept(r) for r in out] == [[0], [0, 1], [0, 1, 2]]


def test_temperature_sharpens():
    p1 = filter_logits(LOGITS, 1.0, -1, 1.0, 0.0).softmax(-1)
    p_low = filter_logits(LOGITS, 0.5, -1, 1.0, 0.0).softmax(-1)
    assert p_low[0] > p1[0]


def _greedy(logits, **kw):
    out = kw.pop("out", [])
    row = SamplingRow(SamplingParams(temperature=0, **kw), [], out, eos_token_ids=(0,))
    return sample(logits[None].clone(), [row]).token_ids.item()


def test_logit_bias_can_force_a_token():
    assert _greedy(LOGITS) == 0
    assert _greedy(LOGITS, logit_bias={3: 5.0}) == 3


def test_min_tokens_masks_eos_until_reached():
    assert _greedy(LOGITS, min_tokens=2, max_tokens=4, out=[1]) == 1  # eos (0) masked
    assert _greedy(LOGITS, min_tokens=2, max_tokens=4, out=[1, 1]) == 0


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, 1.9, -1.0, -1.2])
    # repetition divides a positive logit of a seen token: 2.0 / 2 = 1.0 < 1.9
    assert _greedy(logits, repetition_penalty=2.0, out=[0]) == 1
    # frequency: 2.0 - 2 * 0.1 = 1.8 < 1.9; presence subtracts once: 2.0 - 0.05 > 1.9
    assert _greedy(logits, frequency_penalty=0.1, out=[0, 0]) == 1
    assert _greedy(logits, presence_penalty=0.05, out=[0, 0]) == 0
    # repetition multiplies a negative one: -1.0 * 1.5 = -1.5 < -1.2
    only_neg = torch.tensor([-9.0, -9.0, -1.0, -1.2])
    assert _greedy(only_neg, repetition_penalty=1.5, out=[2]) == 3


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=5)
    alone = sample(logits[2:3].clone(), [SamplingRow(p, [1], [], torch.Generator().manual_seed(5))])
    rows = [SamplingRow(SamplingParams(temperature=1.0), [1], []) for _ in range(4)]
    rows[2] = SamplingRow(p, [1], [], torch.Generator().manual_seed(5))
    batched = sample(logits.clone(), rows)
    assert batched.token_ids[2] == alone.token_ids[0]


def test_exponential_race_samples_the_filtered_distribution():
    g = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=3), [1], [], g)]
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sample(LOGITS[None].clone(), rows).token_ids.item()] += 1
    freq = counts / counts.sum()
    expected = torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9
    assert (freq - expected).abs().max() < 0.03


def test_takes_argmax_only_where_the_sampler_would_take_the_raw_argmax():
    """The compiled decode step's in-graph argmax stands in for sample() exactly where
    SamplingParams.takes_argmax says so; every option that changes the pick, or asks for more, keeps the sampler."""
    plain = dict(temperature=0, max_tokens=4)
    assert SamplingParams(**plain).takes_argmax(0)
    assert SamplingParams(**plain, min_tokens=2).takes_argmax(2)
    for kw, n_out in [(dict(logprobs=0), 0), (dict(logit_bias={3: 5.0}), 0), (dict(repetition_penalty=1.2), 0),
                      (dict(presence_penalty=0.5), 0), (dict(min_tokens=2), 1), (dict(min_tokens=2), 0)]:
        assert not SamplingParams(**{**plain, **kw}).takes_argmax(n_out), kw
    assert not SamplingParams(temperature=0.8, max_tokens=4).takes_argmax(0)
    # where it says so, the sampler's pick is the raw argmax (eos 0 is the argmax here)
    assert _greedy(LOGITS, min_tokens=2, max_tokens=4, out=[1, 1]) == int(LOGITS.argmax())
