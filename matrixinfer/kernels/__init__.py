"""Hand-written CPU kernels for the hot spots PyTorch (eager or compiled) leaves on the table,
each with the PyTorch code it replaces as its reference (tests compare them).

paged_mla_decode (paged_mla_decode.cpp): decode attention over the paged latent cache without
gathering the latents first. Built with torch.utils.cpp_extension on first use (a C++
compiler, as torch.compile itself needs; about a minute) and cached on disk, one build per CPU
kernel level so a shared home never loads a binary its CPU cannot run. If the build fails
the engine keeps the PyTorch path and says so once.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "paged_mla_decode.cpp"
# -ffast-math: glibc offers its vectorised expf only then (a scalar exp per score cost more than
# the rest of the kernel); the kernel keeps no infinities or NaNs for it to mishandle
_state: dict[str, bool] = {}  # "paged_mla_decode" -> loaded


def load_paged_mla_decode() -> bool:
    """Build (once per machine) and load the kernel; False where it cannot be (not built with
    MATRIXINFER_KERNELS=0, no compiler). Call it outside torch.compile tracing: the engine's
    runner does, at construction."""
    if "paged_mla_decode" in _state:
        return _state["paged_mla_decode"]
    ok = False
    if os.environ.get("MATRIXINFER_KERNELS", "1") != "0":
        try:
            from torch.utils import cpp_extension

            if shutil.which("ninja") is None:  # the pip package's binary, when its bin/ is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            level = torch.backends.cpu.get_cpu_capability().lower()
            cpp_extension.load(name=f"matrixinfer_paged_mla_{level}", sources=[str(_SOURCE)],
                               extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
            torch.library.register_fake("matrixinfer::paged_mla_decode")(_fake)
            ok = True
        except Exception as e:  # no compiler, or it failed: the PyTorch path still serves
            log.warning("paged MLA decode kernel not built (%s): decode attention gathers the latents instead",
                        str(e).strip().splitlines()[0][:300])
    _state["paged_mla_decode"] = ok
    return ok


def _fake(q, cache, block_tables, context_lens, scale, rank):
    return q.new_empty(q.shape[0], q.shape[1], rank)


def paged_mla_decode_available(cache: torch.Tensor) -> bool:
    """The kernel serves this cache: it was loaded (by the runner) and the cache is on the CPU."""
    return _state.get("paged_mla_decode", False) and cache.device.type == "cpu"


def paged_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, rank: int) -> torch.Tensor:
    """q [S, H, rank + rope] (the absorbed query), cache [blocks, block_size, rank + rope],
    block_tables [S, W], context_lens [S] -> o_lat [S, H, rank]."""
    return torch.ops.matrixinfer.paged_mla_decode(q, cache, block_tables, context_lens, scale, rank)
