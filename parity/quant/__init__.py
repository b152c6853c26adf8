"""Quantized weights and activations: dequantization, GET_ROWS and the MATMUL contract."""

from parity.quant.activation import Q8Activations, quantize_activations
from parity.quant.blocks import SUPPORTED_TYPES
from parity.quant.dequant import dequantize, get_rows
from parity.quant.gemm import matmul
from parity.quant.prepare import PreparedWeight, prepare_weight

__all__ = [
    "SUPPORTED_TYPES",
    "PreparedWeight",
    "Q8Activations",
    "dequantize",
    "get_rows",
    "matmul",
    "prepare_weight",
    "quantize_activations",
]
