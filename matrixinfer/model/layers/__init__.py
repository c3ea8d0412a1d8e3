"""Building blocks of the model: norms, rotary embeddings, tensor-parallel and quantizable
linear layers (linear.py, quantization.py), the SwiGLU MLP and the stacked routed experts."""

from matrixinfer.model.layers.experts import RoutedExperts
from matrixinfer.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from matrixinfer.model.layers.mlp import MLP
from matrixinfer.model.layers.norm import RMSNorm
from matrixinfer.model.layers.quantization import (
    ExpertsMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedExpertsMethod,
    UnquantizedLinearMethod,
)
from matrixinfer.model.layers.rotary import RotaryEmbedding

__all__ = [
    "MLP", "ColumnParallelLinear", "ExpertsMethodBase", "LinearBase", "LinearMethodBase",
    "MergedColumnParallelLinear", "MergedReplicatedLinear", "QuantizationConfig", "RMSNorm", "ReplicatedLinear",
    "RotaryEmbedding", "RoutedExperts", "RowParallelLinear", "UnquantizedExpertsMethod", "UnquantizedLinearMethod",
    "default_weight_loader",
]
