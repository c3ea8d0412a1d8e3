"""The offline techniques of INT8 without retraining, each a pure function on one layer's
float weight and its calibration statistics (no model in here):

- `smooth_factors`: SmoothQuant's per-input-channel s = max|X|^a / max|W|^(1-a); the caller
  divides the preceding norm (or projection) by s and multiplies W's columns by s, so the
  float product is unchanged and the activation outliers move into the weights.
- `search_alpha`: the smoothing strength a of one layer group that minimises the group's
  INT8 output error on calibration rows.
- `search_clip`: per output channel, the clipping ratio of the weight scale that minimises
  that channel's INT8 output error (channels are independent: each output column of X W^T
  depends on its own row of W only, so a per-row argmin is the exact layer optimum on the grid).
- `gptq_quantize`: block-wise quantization with error compensation. Input channels are
  quantized in blocks of `block` columns; each column's rounding and clipping error is
  pushed onto the not yet quantized columns through the inverse Hessian H = X^T X of the
  calibration inputs (GPTQ, Frantar et al. 2022), which minimises ||X W^T - X Q^T|| instead of
  ||W - Q||.
"""

from __future__ import annotations

import torch

from matrixinfer.quant.int8 import QMAX, quantize_activation, quantize_symmetric, weight_scales

CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5)
ALPHA_GRID = (0.0, 0.25, 0.4, 0.5, 0.6, 0.75)


def fake_quant_activation(x: torch.Tensor, strategy: str = "token") -> torch.Tensor:
    """What the int8 kernel sees of x, back in float (for measuring errors offline only)."""
    q, s = quantize_activation(x, strategy)
    return q.float() * s


def smooth_factors(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """act_max [I]: max|X| per input channel; w_max [I]: max|W| per input column over every
    weight that reads X. alpha 0 means no smoothing (s = 1)."""
    if alpha == 0:
        return torch.ones_like(act_max)
    s = act_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return s.clamp(1e-4, 1e4)


def output_error(x: torch.Tensor, w: torch.Tensor, w_deq: torch.Tensor, act_strategy: str = "token") -> torch.Tensor:
    """Squared INT8 output error per output channel [O]: ||X W^T - Q(X) Q(W)^T||^2 over the rows of x."""
    ref = x @ w.t()
    return (ref - fake_quant_activation(x, act_strategy) @ w_deq.t()).pow(2).sum(0)


def search_clip(w: torch.Tensor, x: torch.Tensor, grid=CLIP_GRID, act_strategy: str = "token") -> torch.Tensor:
    """w [O, I], x [N, I] calibration inputs -> the clip ratio [O] per output channel."""
    w, x = w.float(), x.float()
    errs = []
    for r in grid:
        scale = weight_scales(w, "channel", r)
        errs.append(output_error(x, w, quantize_symmetric(w, scale).float() * scale, act_strategy))
    best = torch.stack(errs).argmin(0)
    return torch.tensor(grid, dtype=torch.float32)[best]


def search_alpha(weights: list[torch.Tensor], x: torch.Tensor, act_max: torch.Tensor, grid=ALPHA_GRID,
                 act_strategy: str = "token") -> float:
    """The smoothing strength for a group of weights [O_k, I] that all read x [N, I]: the one
    whose smoothed, per-channel round-to-nearest INT8 output error summed over the group is least."""
    x = x.float()
    w_max = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)
    best, best_err = 0.0, float("inf")
    for alpha in grid:
        s = smooth_factors(act_max, w_max, alpha)
        xs = x / s
        err = 0.0
        for w in weights:
            ws = w.float() * s
            scale = weight_scales(ws, "channel")
            err += output_error(xs, ws, quantize_symmetric(ws, scale).float() * scale, act_strategy).sum().item()
        if err < best_err:
            best, best_err = alpha, err
    return best


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, block: int = 128,
                  damp: float = 0.01) -> torch.Tensor:
    """w [O, I] float, hessian [I, I] = sum of x x^T over calibration inputs, scale [O, 1] the
    per-channel scales (fixed beforehand, e.g. by search_clip) -> int8 [O, I].

    Columns are quantized left to right; error err_j = (w_j - q_j) / U_jj is subtracted from the
    remaining columns with row j of U, the upper Cholesky factor of H^-1: inside a block at once,
    onto later blocks in one matmul when the block is done (the "lazy batch" of GPTQ).
    `damp` * mean(diag H) is added to the diagonal so a rank-deficient H stays invertible."""
    w = w.detach().float().clone()
    h = hessian.detach().float().clone()
    n = w.shape[1]
    dead = torch.diag(h) == 0  # channels never active: nothing to compensate with
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(n)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w, dtype=torch.int8)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        wb, ub = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        errs = torch.zeros_like(wb)
        for i in range(i2 - i1):
            col = wb[:, i : i + 1]
            qi = torch.clamp(torch.round(col / scale), -QMAX, QMAX)
            q[:, i1 + i] = qi[:, 0].to(torch.int8)
            err = (col - qi * scale) / ub[i, i]
            wb[:, i:] -= err * ub[i : i + 1, i:]
            errs[:, i : i + 1] = err
        w[:, i2:] -= errs @ u[i1:i2, i2:]
    return q
