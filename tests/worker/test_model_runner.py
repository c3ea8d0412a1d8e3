"""The model runner: one step of mixed decode and prefill rows returns sampled token ids (not
logits), the final hidden states when asked (what MTP drafts from), and skips requests whose
KV failed to load."""

import torch

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from matrixinfer.model.loader import load_model
from matrixinfer.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)


def test_step_returns_token_ids_and_hidden_states_of_sampling_rows():
    model = load_model(DEFAULT_MODEL, dtype="float32")
    runner = ModelRunner(model, num_blocks=8, block_size=16, device=torch.device("cpu"))
    prompt = [5, 6, 7, 8, 9, 10]
    rows = [ScheduledRequest("a", prompt, 0, [0], True, GREEDY),
            ScheduledRequest("b", prompt[:3], 0, [1], False),  # a chunk that does not reach the end
            ScheduledRequest("c", [1, 2], 0, [2], True, GREEDY)]
    out = runner.execute_model(SchedulerOutput(rows, num_decode=0, return_hidden_states=True), skip={"c"})
    assert out.request_ids == ["a"] and out.failed_kv_load_request_ids == {"c"}
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0, -1]
        expected = model.compute_logits(hidden).argmax().item()
    assert out.sampled_token_ids == [expected]
    assert torch.allclose(out.hidden_states[0], hidden, atol=1e-5)
