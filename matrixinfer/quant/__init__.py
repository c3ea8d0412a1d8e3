"""INT8 W8A8 without retraining (SPEC section 1): the int8 kernels (int8.py), the layer method
(w8a8.py), the checkpoint layout (compressed_tensors.py) and the offline quantizer
(calibrate.py, algorithms.py, quantize.py)."""

from matrixinfer.quant.compressed_tensors import config_from_dict, config_to_dict
from matrixinfer.quant.w8a8 import W8A8Config

__all__ = ["W8A8Config", "config_from_dict", "config_to_dict"]
