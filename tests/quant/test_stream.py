"""`matrixinfer quantize --stream` (quant/stream.py): the same W8A8 checkpoint as the in-memory
quantizer, to the bit; a killed run resumes after its last finished layer; and its peak memory
is about a layer's, not the model's."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from matrixinfer.quant import stream
from matrixinfer.quant.cli import quantize_checkpoint
from matrixinfer.quant.quantize import QuantizeOptions
from tests.hf_fixtures import make_checkpoint

WINDOWS = torch.randint(2, 97, (6, 20), generator=torch.Generator().manual_seed(0))
OPTS = QuantizeOptions(block_size=16)


def tensors(path):
    out = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(f))
    return out


def quantize(src, out, stream_it):
    torch.manual_seed(0)
    quantize_checkpoint(src, out, OPTS, WINDOWS, batch_size=4, show_progress=False, stream=stream_it)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    make_checkpoint(root / "src", "v3-qlora-yarn", num_hidden_layers=3)
    quantize(root / "src", root / "in-memory", False)
    return root / "src", tensors(root / "in-memory"), json.loads((root / "in-memory" / "config.json").read_text())


def assert_same(out, expected, expected_cfg):
    got = tensors(out)
    assert got.keys() == expected.keys() and any(t.dtype == torch.int8 for t in got.values())
    for k in got:
        assert torch.equal(got[k], expected[k]), k
    assert json.loads((out / "config.json").read_text()) == expected_cfg
    assert not (out / ".partial").exists()


def test_streaming_writes_the_in_memory_checkpoint_to_the_bit(source, tmp_path):
    src, expected, cfg = source
    quantize(src, tmp_path / "out", True)
    assert_same(tmp_path / "out", expected, cfg)


def test_a_killed_run_resumes_after_its_last_finished_layer(source, tmp_path, monkeypatch):
    src, expected, cfg = source
    real, calls = stream.quantize_into, []

    def dies_at_layer_1(src_layer, qlayer, stats, opts, progress=None, prefix=""):
        calls.append(prefix)
        if prefix == "model.layers.1." and len(calls) == 2:
            raise KeyboardInterrupt  # the kill, after layer 0 was written
        return real(src_layer, qlayer, stats, opts, progress, prefix)

    monkeypatch.setattr(stream, "quantize_into", dies_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantize(src, tmp_path / "out", True)
    assert (tmp_path / "out" / ".partial" / "layer-0.safetensors").exists()
    quantize(src, tmp_path / "out", True)
    assert calls == ["model.layers.0.", "model.layers.1.", "model.layers.1.", "model.layers.2."]  # 0 not redone
    assert_same(tmp_path / "out", expected, cfg)


PEAK = """
import sys, threading, time, torch
from matrixinfer.quant.cli import quantize_checkpoint
from matrixinfer.quant.quantize import QuantizeOptions
import matrixinfer.quant.stream, matrixinfer.model.saver, tqdm  # imported before the baseline

def anon():  # resident anonymous memory: the process's own data, not the mapped libraries or files
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon"))

torch.set_num_threads(1)
windows = torch.randint(2, 500, (4, 32), generator=torch.Generator().manual_seed(0))
from matrixinfer.model.loader import load_model
load_model(sys.argv[1], dtype="float32", only=lambda name: False)  # what the first load imports, before the baseline
before, peak, running = anon(), [0], True
def sample():
    while running:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
thread = threading.Thread(target=sample)
thread.start()
quantize_checkpoint(sys.argv[1], sys.argv[2], QuantizeOptions(smooth_alpha=0.5, scale_search=False, clip="none"),
                    windows, batch_size=4, show_progress=False, stream=sys.argv[3] == "1")
running = False
thread.join()
print(max(peak[0], anon()) - before)
"""


def test_peak_memory_is_about_a_layer_not_the_model(tmp_path):
    """11 MoE layers of 15.1 MB each in float32 and a dense one (169 MB): while streaming, the
    process's own memory grows by under 4 layers' worth (a float layer, its int8 copy, its
    statistics, the activations), the in-memory quantizer's by more than the whole float model."""
    from matrixinfer.bench.make_model import write_model

    write_model(tmp_path / "src", "deepseek-v2-lite", 12, vocab_size=512, hidden_size=256, intermediate_size=512,
                moe_intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=64,
                n_routed_experts=16, num_experts_per_tok=2)
    layer_bytes = 15.1e6

    # glibc returns freed blocks above its mmap threshold to the system; it raises the threshold
    # to each freed block's size up to 32 MB, so the test's few-MB tensors would stay in its heap
    # after use. A real model's tensors are all far above 32 MB: fix the threshold to match them.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}

    def peak(stream_it, out):  # the growth of the quantizing process's own memory, sampled every 2 ms
        run = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "src"), str(tmp_path / out), stream_it],
                             capture_output=True, text=True, check=True, env=env)
        return int(run.stdout.split()[-1])

    streamed, in_memory = peak("1", "streamed"), peak("0", "in-memory")
    assert streamed < 4 * layer_bytes < 12 * layer_bytes < in_memory, (streamed, in_memory)
