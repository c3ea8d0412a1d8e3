"""Hand-written CPU operators for the hot spots PyTorch (eager or compiled) leaves on the table,
each with the PyTorch code it replaces as its reference (tests compare them). One C++ file,
cpu_ops.cpp:

- paged_mla_decode: decode attention over the paged latent cache without gathering the
  latents first (the reference: MLAttention._attend_absorbed over gathered latents).
- grouped_mm: (token, expert) rows grouped by expert times their experts' weights, sync-free
  (ATen's _grouped_mm, which torch.compile otherwise traces for bfloat16 only).
- argmax_rows: greedy sampling's argmax over float32 logits rows, vectorised (the reference:
  torch.argmax, first index on ties).
- float32_gemm: whether a bfloat16 product runs faster widened to float32: of many rows on Intel
  CPUs with AVX512-BF16 but no AMX (oneDNN's bfloat16 GEMM reaches about 0.6x MKL's float32
  one; on AMD's it runs 2.2-3.3x ahead, NATIVE_BF16_GEMM), of any size on CPUs with no
  bfloat16 dot products at all (AVX2: ATen's reference loop, ~1%). bfloat16_linear pads an
  eager GEMM's rows to a few counts (gemm_rows) so that oneDNN reuses its primitives.
- small_mm: the few rows of a decode step times their experts' (or one linear's) weights,
  the rows bucketed by expert inside, AVX-512 / AVX512-BF16 multiply-adds into blocks of 16
  outputs over a copy of the weights packed once after loading (pack_small_mm; the reference:
  F.linear per row); built for the dtypes this CPU has instructions for, probed at load.
- fp8_block_mm: rows times float8_e4m3fn weights with a float32 scale per block (DeepSeek-V3's
  FP8 release, `weight_scale_inv`), dequantized block by block inside the product, the rows
  bucketed by expert inside as small_mm does (the reference: fp8_block_mm_reference, F.linear
  over fp8_block_dequant).

Built with torch.utils.cpp_extension on first use (a C++ compiler, as torch.compile itself
needs; ninja from pip) and cached on disk, one build per CPU kernel level so a shared home
never loads a binary its CPU cannot run. If the build fails the engine keeps the PyTorch
paths and says so once.
"""

from __future__ import annotations

import copyreg
import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu_ops.cpp"
# -ffast-math: glibc offers its vectorised expf only then (a scalar exp per score cost more than
# the rest of the kernel); the kernels keep no infinities or NaNs for it to mishandle
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_loaded: bool | None = None  # None until load_cpu_ops ran: then whether the operators are there
_small_mm_dtypes: set[torch.dtype] = set()  # what small_mm was built for on this CPU (AVX-512, AVX512-BF16)

# From how many rows per matrix a bfloat16 GEMM runs in float32 on a CPU with AVX512-BF16 but no
# AMX (2 threads). oneDNN builds a bfloat16 primitive for every new shape, and eager steps meet a
# new row count nearly every call (prefill chunks, mixed steps): with row counts varying call to
# call, bfloat16 took 1.2-1.8x the widened float32 time at 9-15 rows and 1.5-3.5x from 32, and
# the grouped expert GEMM 1.08x at 32 rows per expert, 1.6x at 128. A compiled step's shapes are
# fixed buckets, where bfloat16 holds up better: 0.5-1.1x at 16-64 rows, 1.25-1.5x at 128.
FLOAT32_GEMM_ROWS = {"eager": 9, "compiled": 128}


@functools.cache  # read at import for several constants: one read of /proc/cpuinfo per field
def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset(_cpuinfo("flags").split())


# read once at import: constants to torch.compile
AVX512 = "avx512f" in cpu_flags()  # else the operators run 8-lane AVX2 code (or plain loops)
# torch's x86 wheels multiply float32 with MKL, Intel's BLAS, which at a decode step's few rows
# ran ahead of small_mm on an Intel Xeon and behind it on AMD EPYCs (layers/quantization.py)
INTEL = _cpuinfo("vendor_id") == "GenuineIntel"
AMX_BF16 = "amx_bf16" in cpu_flags()
# bfloat16 dot-product instructions (AMX-BF16 or AVX512-BF16). Without them oneDNN takes no
# bfloat16 GEMM and ATen's reference loop runs it: 0.9 GFLOP/s against MKL's float32 82 on an
# AVX2 EPYC (2 threads, 512 x 1024 x 1024), a batched matmul 49x slower, an einsum 89x.
_BF16_DOT = AMX_BF16 or "avx512_bf16" in cpu_flags()
# Whether bfloat16 GEMMs of many rows stay bfloat16 (oneDNN) rather than widen to float32 (MKL).
# With AVX512-BF16 and no AMX it depends on the vendor: on an Intel Xeon oneDNN's bfloat16 GEMM
# reached about 0.6x MKL's float32 one, so there products widen from FLOAT32_GEMM_ROWS rows; on
# an AMD EPYC (Zen 4, 2 threads) it ran 2.2-3.3x ahead of float32 with the weight widened per
# call at 64-1024 rows, once the shape's primitive was built (0.3-0.6 ms the first time a row
# count is met: eager products pad their rows to gemm_rows so that few row counts ever occur).
NATIVE_BF16_GEMM = AMX_BF16 or (_BF16_DOT and not INTEL)


def float32_gemm(dtype: torch.dtype, device: torch.device, rows: int | None = None, fixed_shape: bool = False) -> bool:
    """Run a bfloat16 product of `rows` rows per matrix in float32 (inputs widened, the result
    rounded back once) on the CPU: always where it has no bfloat16 dot products (_BF16_DOT);
    where bfloat16 GEMMs do not stay native (NATIVE_BF16_GEMM: Intel with AVX512-BF16 but no
    AMX) from FLOAT32_GEMM_ROWS rows (eager calls, or a graph being compiled, or fixed_shape: a
    product whose shape repeats call to call), which were measured for linears and the grouped
    expert GEMM (rows None: another product, kept in bfloat16 there); never with AMX-BF16 or
    on AMD CPUs with AVX512-BF16. Every product of two bfloat16 numbers is exact in float32
    and both GEMMs accumulate in float32, so only the order of the additions differs."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    if not _BF16_DOT:
        return True
    if NATIVE_BF16_GEMM:
        return False
    fixed = fixed_shape or torch.compiler.is_compiling()
    return rows is not None and rows >= FLOAT32_GEMM_ROWS["compiled" if fixed else "eager"]


def gemm_dtype(dtype: torch.dtype, device: torch.device, rows: int | None = None,
               fixed_shape: bool = False) -> torch.dtype:
    """The dtype a product of `rows` rows per matrix of `dtype` tensors multiplies in: float32
    where float32_gemm says so, else dtype itself (so `.to()` on it is free)."""
    return torch.float32 if float32_gemm(dtype, device, rows, fixed_shape) else dtype


def gemm_rows(rows: int) -> int:
    """The row count an eager bfloat16 GEMM of `rows` rows runs at on the CPU: rows padded up
    to a multiple of 16, or of 1/8 of the largest power of two below it (at most 1/8 more rows
    from 128 up), so oneDNN reuses the primitive it built for that count instead of building
    one per prompt length."""
    step = max(16, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


def bfloat16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear of bfloat16 x [..., K] and w [N, K] on the CPU, outside compiled graphs, with
    x's rows padded to gemm_rows (the padding rows' outputs dropped; each output row depends
    on its own input row alone)."""
    rows = x.numel() // x.shape[-1]
    padded = gemm_rows(rows)
    if padded == rows:
        return F.linear(x, w)
    x2 = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    return F.linear(x2, w)[:rows].view(*x.shape[:-1], w.shape[0])


def bfloat16_gemm_policy() -> str:
    """How bfloat16 GEMMs run on this CPU (float32_gemm), in words for logs and reports."""
    if AMX_BF16:
        return "in bfloat16 (AMX-BF16)"
    if not _BF16_DOT:
        return "in float32 (no bfloat16 dot products on this CPU)"
    if NATIVE_BF16_GEMM:
        return "in bfloat16 (AVX512-BF16, not Intel), eager rows padded to gemm_rows"
    return "in float32 from {eager} rows eager, {compiled} compiled (AVX512-BF16, no AMX)".format(**FLOAT32_GEMM_ROWS)


def load_cpu_ops() -> bool:
    """Build (once per machine) and load the operators; False where they cannot be (turned
    off with MATRIXINFER_KERNELS=0, no compiler). Call it outside torch.compile tracing: the
    engine's runner does, at construction."""
    global _loaded
    if _loaded is not None:
        return _loaded
    ok = False
    if os.environ.get("MATRIXINFER_KERNELS", "1") != "0":
        try:
            from torch.utils import cpp_extension

            if shutil.which("ninja") is None:  # the pip package's binary, when its bin/ is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            level = torch.backends.cpu.get_cpu_capability().lower()
            name = f"matrixinfer_cpu_ops_{level}"
            cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            # its C shims must resolve in the compiled graphs' libraries: make its symbols global
            # (torch loads it with ctypes' default, RTLD_LOCAL)
            for path in torch.ops.loaded_libraries:
                if Path(path).name == f"{name}.so":
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            torch.library.register_fake("matrixinfer::paged_mla_decode")(
                lambda q, cache, tables, lens, scale, rank: q.new_empty(q.shape[0], q.shape[1], rank))
            torch.library.register_fake("matrixinfer::grouped_mm")(
                lambda a, b, offs: a.new_empty(a.shape[0], b.shape[-1]))
            torch.library.register_fake("matrixinfer::argmax_rows")(
                lambda x: x.new_empty(x.shape[0], dtype=torch.long))
            torch.library.register_fake("matrixinfer::small_mm")(
                lambda x, w, experts: x.new_empty(x.shape[0], w.shape[1] * SMALL_MM_BLOCK))
            torch.library.register_fake("matrixinfer::fp8_block_mm")(
                lambda x, w, scale, row_block, k_shift, block_k, experts: x.new_empty(x.shape[0], w.shape[-2]))
            _probe_small_mm()
            copyreg.pickle(torch._ops.OpOverload, _pickle_operator)  # c_shims' cache key (its docstring)
            ok = True
        except Exception as e:  # no compiler, or it failed: the PyTorch paths still serve
            log.warning("matrixinfer CPU operators not built (%s): the PyTorch paths serve instead",
                        str(e).strip().splitlines()[0][:300])
    _loaded = ok
    return ok


# The operators' C shims in cpu_ops.cpp (their declarations, as inductor's C++ launcher declares
# and calls them): with these a compiled graph calls an operator directly. Without them it
# looked each one up by name and called it boxed through the dispatcher, with a new tensor
# handle per argument, at every call (~40 calls a batch-1 bfloat16 step of the bundled model).
_C_SHIMS = {
    "paged_mla_decode": "AOTITorchError aoti_torch_cpu_paged_mla_decode(AtenTensorHandle q, AtenTensorHandle cache, "
                        "AtenTensorHandle block_tables, AtenTensorHandle context_lens, double scale, int64_t rank, "
                        "AtenTensorHandle* ret0)",
    "small_mm": "AOTITorchError aoti_torch_cpu_small_mm(AtenTensorHandle x, AtenTensorHandle w, "
                "AtenTensorHandle* experts, AtenTensorHandle* ret0)",
    "grouped_mm": "AOTITorchError aoti_torch_cpu_grouped_mm(AtenTensorHandle a, AtenTensorHandle b, "
                  "AtenTensorHandle offs, AtenTensorHandle* ret0)",
}


def _operator(qualified_name: str, overload: str) -> torch._ops.OpOverload:
    namespace, name = qualified_name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _pickle_operator(op: torch._ops.OpOverload):
    return _operator, (op._schema.name, op._overloadname)


def c_shims() -> dict:
    """inductor's aot_inductor.custom_ops_to_c_shims for the loaded operators (empty where
    they are not: the graph then has none of them to call).

    The option is part of inductor's FX-graph and AOTAutograd cache keys, and an OpOverload
    does not pickle (a pybind11 record inside): every compile bypassed both caches, so each
    engine start compiled from scratch (the test model: 80 s with a warm cache dir, as cold).
    Operators pickle by name (copyreg, Python's own hook, registered once by load_cpu_ops), so
    the key is their names and the shims' declarations, and a restart loads the compiled
    graphs from disk."""
    if not _loaded:
        return {}
    return {getattr(torch.ops.matrixinfer, name).default: [decl] for name, decl in _C_SHIMS.items()}


def cpu_ops_serve(device: torch.device) -> bool:
    """The operators serve tensors on `device`: they were loaded (by the runner) and it is the CPU."""
    return bool(_loaded) and device.type == "cpu"


def paged_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, rank: int) -> torch.Tensor:
    """q [S, H, rank + rope] (the absorbed query), cache [blocks, block_size, rank + rope],
    block_tables [S, W], context_lens [S] (each >= 1) -> o_lat [S, H, rank]."""
    return torch.ops.matrixinfer.paged_mla_decode(q, cache, block_tables, context_lens, scale, rank)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [P, K] rows grouped by expert, b [E, K, N], offs [E] int32: the end row of each
    expert's group -> [P, N], each group times its expert's matrix."""
    return torch.ops.matrixinfer.grouped_mm(a, b, offs)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] -> [S] int64, the first index of each row's maximum: the operator for float32
    rows on the CPU, torch.argmax otherwise."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] and cpu_ops_serve(x.device):
        return torch.ops.matrixinfer.argmax_rows(x)
    return x.argmax(dim=-1)


def _probe_small_mm() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        try:
            w = torch.ones(1, SMALL_MM_BLOCK, 4, dtype=dtype)
            torch.ops.matrixinfer.small_mm(torch.ones(1, 4, dtype=dtype), _pack(w), None)
            _small_mm_dtypes.add(dtype)
        except RuntimeError:  # "not built for": this CPU lacks the instructions
            pass


def small_mm_serves(dtype: torch.dtype, device: torch.device) -> bool:
    """small_mm takes tensors of `dtype` on `device` here."""
    return dtype in _small_mm_dtypes and cpu_ops_serve(device)


SMALL_MM_BLOCK = 16  # outputs per packed block


def _pair_width(dtype: torch.dtype) -> int:
    """Values along K per packed step: bfloat16 in pairs (one dot-product instruction), else 1."""
    return 2 if dtype == torch.bfloat16 else 1


def _pack(w: torch.Tensor) -> torch.Tensor:
    e, n, k = w.shape
    v = _pair_width(w.dtype)
    return w.reshape(e, n // SMALL_MM_BLOCK, SMALL_MM_BLOCK, k // v, v).permute(0, 1, 3, 2, 4).contiguous()


def pack_small_mm(w: torch.Tensor, pad_outputs: bool = False) -> torch.Tensor | None:
    """w [E, N, K] or [N, K] (nn.Linear's layout) -> the copy small_mm multiplies by
    ([E, N/16, K/V, 16, V], V = 2 for bfloat16, 1 for float32), or None where small_mm does not
    serve: another dtype or device, no operators, N not a multiple of 16 (unless pad_outputs:
    zero rows up to the next multiple, whose outputs the caller drops) or K of V."""
    w3 = w if w.dim() == 3 else w[None]
    if pad_outputs and w3.shape[1] % SMALL_MM_BLOCK:
        w3 = F.pad(w3, (0, 0, 0, -w3.shape[1] % SMALL_MM_BLOCK))
    if not small_mm_serves(w.dtype, w.device) or w3.shape[1] % SMALL_MM_BLOCK or w3.shape[2] % _pair_width(w.dtype):
        return None
    return _pack(w3.detach())


def small_mm(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """x [P, K], w from pack_small_mm ([E, N, K] packed), experts [P] int64: each row's matrix
    (None: w holds one, E = 1) -> [P, N], row p times w[experts[p]] transposed. For a few rows;
    F.linear per row is the reference."""
    return torch.ops.matrixinfer.small_mm.default(x, w, experts)


def fp8_block_dequant(w: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, k_shift: int = 0,
                      block_k: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] float8_e4m3fn, scale [..., RB, KB] float32, row_block [N]: each output row's
    scale row -> w times its block's scale, in `dtype` (column k takes scale column
    (k + k_shift) // block_k). The PyTorch reference of fp8_block_mm's dequantization."""
    k = w.shape[-1]
    s = scale.float().index_select(-2, row_block.to(device=scale.device, dtype=torch.long))
    s = s.repeat_interleave(block_k, dim=-1).narrow(-1, k_shift, k)
    return (w.float() * s).to(dtype)


def fp8_block_mm_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor,
                           k_shift: int = 0, block_k: int = 128, experts: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_block_mm in PyTorch: F.linear over the dequantized weights (in x's dtype), per expert."""
    if experts is None:
        return F.linear(x, fp8_block_dequant(w if w.dim() == 2 else w[0], scale if scale.dim() == 2 else scale[0],
                                             row_block, k_shift, block_k, x.dtype))
    out = x.new_empty(x.shape[0], w.shape[-2])
    for e in experts.unique().tolist():  # reads the experts on the host: eager use (or a fallback)
        rows = (experts == e).nonzero().flatten()
        out[rows] = F.linear(x[rows], fp8_block_dequant(w[e], scale[e], row_block, k_shift, block_k, x.dtype))
    return out


def fp8_block_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, row_block: torch.Tensor, k_shift: int = 0,
                 block_k: int = 128, experts: torch.Tensor | None = None) -> torch.Tensor:
    """x [P, K] times block-scaled float8_e4m3fn weights w [E, N, K] (or [N, K], experts None),
    scale [E, RB, KB], row_block [N] int32, experts [P]: each row's matrix -> [P, N] in x's dtype:
    the operator for float32 / bfloat16 rows on the CPU, fp8_block_mm_reference otherwise."""
    if x.dtype in (torch.float32, torch.bfloat16) and cpu_ops_serve(x.device):
        return torch.ops.matrixinfer.fp8_block_mm.default(x, w, scale, row_block, k_shift, block_k, experts)
    return fp8_block_mm_reference(x, w, scale, row_block, k_shift, block_k, experts)
