"""`matrixinfer simulate paper-tables --json` and the other CLI commands."""

import argparse
import json
import math

import pytest

from matrixinfer.sim.cli import register


def main(argv: list[str]) -> int:
    """`matrixinfer <argv>` with only this subsystem's commands registered (the top-level
    CLI imports every subsystem; a broken one elsewhere must not hide these results)."""
    parser = argparse.ArgumentParser(prog="matrixinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, sub.add_parser("bench").add_subparsers(dest="bench_command"))
    args = parser.parse_args(argv)
    return args.func(args)

SCENARIOS = {
    "decode-cm384-4k-b96": ["tpot_ms", "tokens_per_s_per_npu"],
    "decode-cm384-1k1k-b128": ["tpot_ms", "tokens_per_s_per_npu"],
    "decode-cm384-2k256-b112": ["tpot_ms", "tokens_per_s_per_npu"],
    "decode-cm384-4k256-b24": ["tpot_ms", "tokens_per_s_per_npu"],
    "decode-cm384-4k256-b8": ["tpot_ms", "tokens_per_s_per_npu"],
    "prefill-cm384-4k": ["tokens_per_s_per_npu"],
    "decode-h800-b128": ["tpot_ms", "tokens_per_s_per_npu"],
    "prefill-h800-4k": ["tokens_per_s_per_npu"],
    "dispatch-cm384-ep8": ["latency_us"],
    "dispatch-cm384-ep256": ["latency_us"],
    "combine-cm384-ep8": ["latency_us"],
    "combine-cm384-ep256": ["latency_us"],
    "context-cache-cm384-50": ["prefill_throughput_ratio", "ttft_reduction"],
    "context-cache-cm384-90": ["prefill_throughput_ratio", "ttft_reduction"],
    "model-cache-671b-8": ["direct_s", "ems_s"],
    "allocation-224-10.08": ["allocation_rate"],
    "allocation-384-10.08": ["allocation_rate"],
    "allocation-224-11.28": ["allocation_rate"],
}
FRACTIONS = {"ttft_reduction", "allocation_rate"}


@pytest.fixture(scope="module")
def capsys_module():
    """stdout of `matrixinfer simulate paper-tables --json`, run once for the module."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["simulate", "paper-tables", "--json"]) == 0
    return buf.getvalue()


def test_prints_exactly_one_json_object(capsys_module):
    """stdout is one JSON object with the single key 'scenarios'."""
    obj = json.loads(capsys_module)
    assert list(obj) == ["scenarios"]


def test_all_scenarios_and_metrics_present(capsys_module):
    """Every scenario ID and metric of the issue appears, with no extras."""
    got = json.loads(capsys_module)["scenarios"]
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in SCENARIOS.items()}


def test_values_finite_positive_and_fractions_bounded(capsys_module):
    """All values are finite and > 0; fractions lie in (0, 1]."""
    for sid, metrics in json.loads(capsys_module)["scenarios"].items():
        for name, v in metrics.items():
            assert math.isfinite(v) and v > 0, (sid, name, v)
            if name in FRACTIONS:
                assert v <= 1, (sid, name, v)


def test_published_comparisons(capsys_module):
    """Comparison targets (not inputs): calibration reproduced; paper prefill 6,688 and decode
    538 tokens/s at batch 8 within 15 %; TPOT below 50 ms at 1K/1K b128 and below 30 ms at b24;
    more cache hits help more; EMS model loading beats direct; bigger supernode allocates more."""
    s = json.loads(capsys_module)["scenarios"]
    assert s["decode-cm384-4k-b96"]["tpot_ms"] == pytest.approx(49.4, rel=0.005)
    assert s["decode-cm384-4k-b96"]["tokens_per_s_per_npu"] == pytest.approx(1943, rel=0.005)
    assert s["prefill-cm384-4k"]["tokens_per_s_per_npu"] == pytest.approx(6688, rel=0.15)
    assert s["decode-cm384-4k256-b8"]["tokens_per_s_per_npu"] == pytest.approx(538, rel=0.15)
    assert s["decode-cm384-1k1k-b128"]["tpot_ms"] < 50
    assert s["decode-cm384-4k256-b24"]["tpot_ms"] < 30
    assert s["context-cache-cm384-90"]["ttft_reduction"] > s["context-cache-cm384-50"]["ttft_reduction"]
    assert s["model-cache-671b-8"]["ems_s"] < s["model-cache-671b-8"]["direct_s"] / 4
    assert s["allocation-384-10.08"]["allocation_rate"] > s["allocation-224-10.08"]["allocation_rate"]
    assert s["dispatch-cm384-ep256"]["latency_us"] > s["dispatch-cm384-ep8"]["latency_us"]


@pytest.mark.parametrize("argv", [
    ["simulate", "decode", "--sweep", "8", "96", "--json"],
    ["simulate", "decode", "--expert-skew", "1.0", "--json"],
    ["simulate", "prefill", "--cache-hit", "0.5", "--compare-dp", "--json"],
    ["simulate", "dispatch", "--hardware", "h800", "--precision", "fp8", "--json"],
    ["simulate", "allocation", "--sizes", "224", "384", "--means", "8", "10.08", "--jobs", "500", "--json"],
    ["simulate", "allocation", "--sizes", "224", "--means", "8", "--jobs", "500", "--relaxed", "--json"],
    ["simulate", "serve", "--requests", "50", "--rate", "5", "--json"],
    ["simulate", "calibrate", "--json"],
])
def test_cli_commands_print_json(argv, capsys):
    """Each simulate subcommand exits 0 and its --json output parses."""
    assert main(argv) == 0
    json.loads(capsys.readouterr().out)
