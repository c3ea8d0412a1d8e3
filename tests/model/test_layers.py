"""Linear layers and stacked experts on a fake 2-rank layout (explicit tp_rank/tp_size, no
process group): each rank holds and loads its shard, the shards recombine to the full
matmul, and the quant_method hook is the only path to the weights."""

import pytest
import torch
import torch.nn.functional as F

from matrixinfer.model.layers import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    QuantizationConfig,
    ReplicatedLinear,
    RMSNorm,
    RoutedExperts,
    RowParallelLinear,
    UnquantizedExpertsMethod,
    UnquantizedLinearMethod,
)
from matrixinfer.kernels import AVX512, load_cpu_ops, small_mm_serves
from matrixinfer.model.layers.quantization import SMALL_MM_REPEATED_ROWS
from matrixinfer.model.loader import load_model
from tests.hf_fixtures import make_checkpoint

G = torch.Generator().manual_seed(0)
X = torch.randn(3, 4, generator=G)
W = torch.randn(6, 4, generator=G)


def load(layer, full, shard_id=None):
    layer.weight.weight_loader(layer.weight, full, shard_id)
    return layer


def test_column_parallel_rank_holds_its_output_rows():
    ranks = [load(ColumnParallelLinear(4, 6, tp_rank=r, tp_size=2), W) for r in (0, 1)]
    for r, layer in enumerate(ranks):
        assert layer.weight.shape == (3, 4)
        assert torch.equal(layer.weight, W[3 * r:3 * r + 3])
    assert torch.allclose(torch.cat([layer(X) for layer in ranks], dim=-1), X @ W.T, atol=1e-6)


def test_row_parallel_partial_sums_add_up_to_the_full_output():
    w = W.T.contiguous()  # [4, 6]: input 6 split over the ranks
    x = torch.randn(3, 6, generator=G)
    ranks = [load(RowParallelLinear(6, 4, reduce_results=False, tp_rank=r, tp_size=2), w) for r in (0, 1)]
    assert ranks[1].weight.shape == (4, 3) and torch.equal(ranks[1].weight, w[:, 3:])
    partial = [layer(x[:, 3 * r:3 * r + 3]) for r, layer in enumerate(ranks)]
    assert torch.allclose(partial[0] + partial[1], x @ w.T, atol=1e-6)


def test_merged_column_rank_holds_its_slice_of_each_projection():
    gate, up = torch.randn(6, 4, generator=G), torch.randn(6, 4, generator=G)
    for r in (0, 1):
        layer = MergedColumnParallelLinear(4, [6, 6], tp_rank=r, tp_size=2)
        load(load(layer, gate, 0), up, 1)
        assert layer.output_partition_sizes == [3, 3]
        assert torch.equal(layer.weight, torch.cat([gate[3 * r:3 * r + 3], up[3 * r:3 * r + 3]]))


def test_merged_replicated_is_both_projections_in_one_matmul():
    a, b = torch.randn(5, 4, generator=G), torch.randn(2, 4, generator=G)
    layer = MergedReplicatedLinear(4, [5, 2], tp_rank=1, tp_size=2)  # replicated: rank ignored
    load(load(layer, a, 0), b, 1)
    ya, yb = layer(X).split(layer.output_sizes, dim=-1)
    assert torch.allclose(ya, X @ a.T, atol=1e-6) and torch.allclose(yb, X @ b.T, atol=1e-6)


def test_loader_checks_the_full_checkpoint_shape():
    with pytest.raises(ValueError, match=r"\(5, 4\).*\(6, 4\)"):
        load(ColumnParallelLinear(4, 6, tp_rank=0, tp_size=2), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="shard_id"):
        load(MergedColumnParallelLinear(4, [6, 6], tp_rank=0, tp_size=2), W)


def test_sizes_that_do_not_split_evenly_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(4, 5, tp_rank=0, tp_size=2)


def test_experts_shard_the_intermediate_dimension_and_sum_to_the_full_output():
    """Two ranks each hold half of every local expert's intermediate dimension; their partial
    outputs add up to the experts computed whole."""
    h, i, ids = 4, 6, [1, 3]
    w = {(e, p): torch.randn(*((h, i) if p == "down_proj" else (i, h)), generator=G)
         for e in ids for p in ("gate_proj", "up_proj", "down_proj")}
    ranks = []
    for r in (0, 1):
        experts = RoutedExperts(4, h, i, expert_ids=ids, tp_rank=r, tp_size=2)
        for (e, piece), t in w.items():
            param = experts.w2_weight if piece == "down_proj" else experts.w13_weight
            param.weight_loader(param, t, (e, piece))
        ranks.append(experts)
    assert ranks[1].w13_weight.shape == (2, 6, 4) and ranks[1].w2_weight.shape == (2, 4, 3)
    assert torch.equal(ranks[1].w13_weight[1], torch.cat([w[3, "gate_proj"][3:], w[3, "up_proj"][3:]]))
    assert torch.equal(ranks[1].w2_weight[1], w[3, "down_proj"][:, 3:])
    with pytest.raises(ValueError, match="not held"):
        ranks[0].w2_weight.weight_loader(ranks[0].w2_weight, w[1, "down_proj"], (2, "down_proj"))
    x = torch.randn(5, h, generator=G)
    route_ids = torch.tensor([[1, 3], [3, 0], [1, 2], [0, 2], [3, 1]])
    route_w = torch.rand(5, 2, generator=G)
    with torch.no_grad():
        out = ranks[0](x, route_w, route_ids) + ranks[1](x, route_w, route_ids)
    ref = torch.zeros_like(x)
    for t in range(5):
        for k, e in enumerate(route_ids[t].tolist()):
            if e in ids:
                y = F.silu(x[t] @ w[e, "gate_proj"].T) * (x[t] @ w[e, "up_proj"].T)
                ref[t] += route_w[t, k] * (y @ w[e, "down_proj"].T)
    assert torch.allclose(out, ref, atol=1e-5)


class Recording(QuantizationConfig):
    """Records which layers run through the hook and doubles the LM head's output."""

    def __init__(self):
        self.applied, self.processed = set(), set()

    def get_linear_method(self, layer, prefix):
        config = self

        class Method(UnquantizedLinearMethod):
            def apply(self, layer, x):
                config.applied.add(prefix)
                return super().apply(layer, x) * (2.0 if prefix == "lm_head" else 1.0)

            def process_weights_after_loading(self, layer):
                config.processed.add(prefix)

        return Method()

    def get_experts_method(self, layer, prefix):
        config = self

        class Method(UnquantizedExpertsMethod):
            def apply(self, layer, xs, local, counts):
                config.applied.add(prefix)
                return super().apply(layer, xs, local, counts)

            def apply_all(self, layer, x):
                config.applied.add(prefix)
                return super().apply_all(layer, x)

            def apply_pairs(self, layer, x, local):
                config.applied.add(prefix)
                return super().apply_pairs(layer, x, local)

            def apply_grouped_mm(self, layer, xs, offs):
                config.applied.add(prefix)
                return super().apply_grouped_mm(layer, xs, offs)

            def apply_small_mm(self, layer, xs, experts):
                config.applied.add(prefix)
                return super().apply_small_mm(layer, xs, experts)

        return Method()


def test_quant_method_is_the_only_path_to_the_weights(tmp_path):
    make_checkpoint(tmp_path, "v3-qlora-yarn")
    plain = load_model(tmp_path, dtype="float32")
    recording = Recording()
    model = load_model(tmp_path, dtype="float32", quant_config=recording)
    layers = {name for name, m in model.named_modules()
              if isinstance(m, (LinearBase, RoutedExperts)) and ".mtp." not in name}
    assert recording.processed == {n for n, m in model.named_modules() if isinstance(m, LinearBase)}
    ids, pos = torch.arange(10)[None], torch.arange(10)[None]
    with torch.no_grad():
        doubled = model.compute_logits(model(ids, pos))
        ref = plain.compute_logits(plain(ids, pos))
    assert recording.applied == layers
    assert torch.allclose(doubled, 2 * ref, atol=1e-5)


@pytest.mark.parametrize("subset", [None, [0, 2, 3, 5, 6]])
def test_the_expert_paths_agree(subset):
    """The sync-free paths (gathered pair weights, every local expert, and with all experts
    local the grouped matmul operator) give the grouped path's output, with all experts local
    and with a subset held (EP); the shapes pick the paths (the few-rows operator once its
    packed copies exist)."""
    h, i, n_exp = 16, 8, 7  # rows of 32 and 64 bytes: what the grouped matmul operator takes
    experts = RoutedExperts(n_exp, h, i, expert_ids=subset)
    with torch.no_grad():
        experts.w13_weight.normal_(generator=G)
        experts.w2_weight.normal_(generator=G)
    load_cpu_ops()
    experts.quant_method.pack_small_mm(experts)
    x = torch.randn(3, h, generator=G)
    ids = torch.tensor([[1, 3], [6, 0], [2, 5]])
    weights = torch.rand(3, 2, generator=G)
    with torch.no_grad():
        grouped = experts(x, weights, ids, path="grouped")
        ops = ["grouped_mm", "small_mm"] if load_cpu_ops() and small_mm_serves(torch.float32, x.device) else []
        paths = ["all"] + (["pairs"] + ops if subset is None else [])
        for path in paths:
            assert torch.allclose(experts(x, weights, ids, path=path), grouped, atol=1e-5), path
    assert experts.path(1, 2) == ("pairs" if subset is None else "all")
    cpu = torch.device("cpu")
    if subset is None and ops:  # a few pairs per expert: the operator, but float32 with AVX-512 keeps pairs at 1 token
        assert experts.path(1, 2, cpu, torch.float32) == ("pairs" if AVX512 else "small_mm")
        assert experts.path(3, 2, cpu, torch.float32) == "small_mm"
        bf16 = RoutedExperts(n_exp, h, i, params_dtype=torch.bfloat16)  # bfloat16 takes the operator at 1 token too
        assert bf16.path(1, 2, cpu, torch.bfloat16) == "pairs"  # not packed yet
        bf16.quant_method.pack_small_mm(bf16)
        assert bf16.path(1, 2, cpu, torch.bfloat16) == ("small_mm" if small_mm_serves(torch.bfloat16, cpu) else "pairs")
    big = "grouped_mm" if subset is None and load_cpu_ops() else "all"
    assert experts.path(14, 2, cpu) == big and experts.path(14, 2) == "all"  # no device: no operator
    assert RoutedExperts(64, h, i).path(3, 2) == "pairs" and RoutedExperts(64, h, i).path(40, 2) == "grouped"
    assert RoutedExperts(n_exp, h, 6).path(14, 2, cpu) == "all"  # 24-byte rows: not for the operator


def test_gemm_rows_pads_to_few_row_counts():
    """kernels.gemm_rows, the row count an eager bfloat16 GEMM pads to so that oneDNN reuses
    its primitives: never fewer rows, at most 1/8 more from 128 rows (15 below), monotonic,
    and few distinct counts for every prompt length up to 8,192 tokens (one primitive per
    count and weight shape, against oneDNN's cache of 1,024)."""
    from matrixinfer.kernels import gemm_rows

    padded = [gemm_rows(r) for r in range(1, 8193)]
    for r, p in enumerate(padded, start=1):
        assert p >= r and p - r <= max(15, r // 8) and p % 16 == 0
        assert gemm_rows(p) == p  # a padded count stays as it is
    assert padded == sorted(padded) and len(set(padded)) <= 70


@pytest.mark.parametrize("cpu", ["avx512_bf16_intel", "avx512_bf16_amd", "amx", "no_bf16"])
def test_bfloat16_products_multiply_in_float32_by_cpu(monkeypatch, cpu):
    """A bfloat16 linear or grouped expert GEMM runs in float32 (the result rounded once): from
    FLOAT32_GEMM_ROWS rows on an Intel CPU with AVX512-BF16 but no AMX (a graph being compiled,
    with fixed shapes, from more rows), at every size on a CPU with no bfloat16 dot products,
    and never with AMX-BF16 or on an AMD CPU with AVX512-BF16 (NATIVE_BF16_GEMM), where eager
    calls pad their rows to gemm_rows and keep the unpadded rows' results; both agree within
    bfloat16 rounding. The other products (rows None) widen only without bfloat16 dot products."""
    import matrixinfer.kernels as kernels

    amx = cpu == "amx"
    native = amx or cpu == "avx512_bf16_amd"  # bfloat16 GEMMs stay bfloat16 at every size
    monkeypatch.setattr(kernels, "AMX_BF16", amx)
    monkeypatch.setattr(kernels, "_BF16_DOT", cpu != "no_bf16")
    monkeypatch.setattr(kernels, "NATIVE_BF16_GEMM", native)
    eager, compiled = kernels.FLOAT32_GEMM_ROWS["eager"], kernels.FLOAT32_GEMM_ROWS["compiled"]
    assert kernels.gemm_dtype(torch.bfloat16, torch.device("cpu")) == (torch.float32 if cpu == "no_bf16"
                                                                       else torch.bfloat16)
    assert kernels.gemm_dtype(torch.float32, torch.device("cpu"), 1000) == torch.float32
    layer = ColumnParallelLinear(64, 96, params_dtype=torch.bfloat16)
    w = torch.randn(96, 64, generator=G).bfloat16()
    load(layer, w)
    load_cpu_ops()
    layer.quant_method.pack_small_mm(layer)  # as the runner does: the operator's copy, where it serves
    x = torch.randn(compiled + 1, 64, generator=G).bfloat16()
    with torch.no_grad():
        for rows, compiling in ((1, False), (eager, False), (compiled, False), (compiled, True), (compiled - 1, True),
                                (compiled + 1, False)):
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
            widened, unpadded = F.linear(x[:rows].float(), w.float()).bfloat16(), F.linear(x[:rows], w)
            padded = F.linear(F.pad(x[:rows], (0, 0, 0, kernels.gemm_rows(rows) - rows)), w)[:rows]
            out = layer(x[:rows])
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
            narrow = native or (cpu == "avx512_bf16_intel" and rows < (compiled if compiling else eager))
            if rows > 1 or not small_mm_serves(torch.bfloat16, torch.device("cpu")):  # one row: the operator
                assert torch.equal(out, (unpadded if compiling else padded) if narrow else widened)
            assert torch.allclose(widened.float(), unpadded.float(), rtol=1e-2, atol=1e-2)
            assert torch.allclose(padded.float(), unpadded.float(), rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    # the logits' linear (rows_repeat: the same row count step after step) has fixed shapes in
    # eager calls too: past small_mm's rows it keeps bfloat16 below the compiled threshold
    head = load(ReplicatedLinear(64, 96, params_dtype=torch.bfloat16, rows_repeat=True), w)
    head.quant_method.pack_small_mm(head)
    with torch.no_grad():
        rows = SMALL_MM_REPEATED_ROWS[torch.bfloat16] + 1
        assert eager < rows < compiled
        unpadded, widened = F.linear(x[:rows], w), F.linear(x[:rows].float(), w.float()).bfloat16()
        assert torch.equal(head(x[:rows]), widened if cpu == "no_bf16" else unpadded)  # not padded: one shape
        if small_mm_serves(torch.bfloat16, torch.device("cpu")):  # up to its rows, the operator
            rows -= 1
            out = head(x[:rows]).float()
            assert torch.allclose(out, F.linear(x[:rows].float(), w.float()), rtol=1e-2, atol=1e-2)
    rows = compiled
    if not load_cpu_ops():
        return
    n_exp, h, i = 4, 64, 32
    experts = RoutedExperts(n_exp, h, i, params_dtype=torch.bfloat16)
    with torch.no_grad():
        experts.w13_weight.normal_(generator=G)
        experts.w2_weight.normal_(generator=G)
        xs = torch.randn(n_exp * rows, h, generator=G).bfloat16()
        offs = torch.arange(1, n_exp + 1, dtype=torch.int32) * rows
        out = experts.quant_method.apply_grouped_mm(experts, xs, offs)
        ref = []
        for e, rows_e in enumerate(xs.float().split(rows)):  # float32 per expert
            gate, up = F.linear(rows_e, experts.w13_weight[e].float()).chunk(2, -1)
            ref.append(F.linear(F.silu(gate) * up, experts.w2_weight[e].float()))
        ref = torch.cat(ref)
        assert out.dtype == torch.bfloat16
        if native:  # bfloat16 throughout: the intermediate activations are rounded too
            assert (out.float() - ref).norm() / ref.norm() < 1e-2
        else:  # float32 throughout, rounded once at the end
            assert torch.allclose(out.float(), ref, rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_eager_equals_the_strided_form_compiled_graphs_read(monkeypatch, dtype):
    """RotaryEmbedding's eager path de-interleaves DeepSeek's rope pairs with one copy before
    rotating; inside a compiled graph it reads the stride-2 views. Both give the same numbers
    (bit for bit: the same products and sums), on the query's strided slice of q as served."""
    from matrixinfer.config import RopeConfig
    from matrixinfer.model.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(RopeConfig(interleave=True), 64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(37, 8, 128, generator=g).to(dtype)[..., 64:]  # q_pe: a strided view of q
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (37,), generator=g), dtype)
    eager = rope(q, cos, sin)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    strided = rope(q, cos, sin)
    x1, x2 = q.float()[..., 0::2], q.float()[..., 1::2]
    c, s = cos.float()[:, None], sin.float()[:, None]
    assert torch.equal(eager, strided) and eager.shape == q.shape
    assert torch.allclose(eager.float(), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1), rtol=2e-2, atol=2e-2)


def test_grouped_experts_pad_each_group_to_gemm_rows(monkeypatch):
    """Eager bfloat16 grouped expert GEMMs on the CPU pad every expert's group to gemm_rows
    (uneven groups, an empty one included) and return the rows of the unpadded grouped
    matmul; _pad_groups places each row after its group's padded start. The products are kept in
    bfloat16 as on CPUs where they stay so (an Intel CPU without AMX widens these to float32,
    which pads nothing and is not what this checks)."""
    from matrixinfer.kernels import gemm_rows
    from matrixinfer.model.layers import quantization
    from matrixinfer.model.layers.quantization import _grouped_swiglu, _pad_groups

    monkeypatch.setattr(quantization, "gemm_dtype", lambda dtype, *args, **kwargs: dtype)

    if not load_cpu_ops():
        pytest.skip("no C++ compiler to build the grouped matmul operator")
    counts = [37, 0, 130, 5]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), 64, generator=G).bfloat16()
    padded, place, padded_offs = _pad_groups(xs, offs)
    assert padded_offs.tolist() == [48, 48, 48 + gemm_rows(130), 48 + gemm_rows(130) + 16]
    assert torch.equal(padded[place], xs) and padded.shape[0] == padded_offs[-1]
    assert place[:37].tolist() == list(range(37)) and place[37] == 48  # the third group starts past 48 rows
    experts = RoutedExperts(4, 64, 32, params_dtype=torch.bfloat16)
    with torch.no_grad():
        experts.w13_weight.normal_(generator=G)
        experts.w2_weight.normal_(generator=G)
        out = experts.quant_method.apply_grouped_mm(experts, xs, offs)
        ref = _grouped_swiglu(xs, experts.w13_weight, experts.w2_weight, offs)
    assert out.shape == ref.shape and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_layers_give_a_row_the_same_bits_among_any_rows(dtype):
    """The mode's RMSNorm and linear (model/batch_invariant.py): a row's output is bitwise the
    same alone, among 5, 37 or 600 rows, at any place among them, eagerly and in compiled
    graphs of static and dynamic shapes (a compiled reduction over the row otherwise picks its
    lanes by the graph's shapes)."""
    if not (load_cpu_ops() and small_mm_serves(dtype, torch.device("cpu"))):
        pytest.skip("the CPU operators do not serve this dtype here")
    from matrixinfer.kernels import pack_small_mm

    torch.manual_seed(0)
    norm, proj = RMSNorm(200), ReplicatedLinear(200, 300, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(200) + 0.5)
        proj.weight.normal_()
    norm = norm.to(dtype)
    norm.batch_invariant = proj.batch_invariant = True
    norm.ones_small_mm = pack_small_mm(torch.ones(16, 200))
    proj.quant_method.pack_small_mm(proj)
    x = torch.randn(600, 200).to(dtype) * 3
    torch._dynamo.reset()  # the other dtype's graphs count towards the frame's recompile limit
    step = torch.inference_mode()(lambda rows: proj(norm(rows)))  # as the engine runs its steps
    # each way of running against itself: compiled graphs round their fused work differently
    # from eager (the mode makes each invariant, not the two equal)
    for way, fn in (("eager", step), ("static", torch.compile(step, dynamic=False)),
                    ("dynamic", torch.compile(step, dynamic=True))):
        with torch.inference_mode():
            alone = torch.cat([fn(x[i:i + 1]) for i in (0, 4, 36, 599)])
            for n in (5, 37, 600):
                got = fn(x[:n].roll(1, 0))  # row i at place i + 1
                for j, i in enumerate((0, 4, 36, 599)):
                    if i < n:
                        assert torch.equal(got[(i + 1) % n], alone[j]), (way, n, i)
