"""Compiled kernels of our own, built at first use with the system C compiler."""

from tailguard.model.kernels.attn_bf16 import PrefillAttention, load_prefill_attention
from tailguard.model.kernels.decode import DecodeStack, load_decode_stack
from tailguard.model.kernels.rows import RowKernel, load_row_kernel
from tailguard.model.kernels.small_m import (
    LinearKernel,
    SmallMKernel,
    load_small_m_kernel,
    small_m_unavailable_reason,
)
from tailguard.model.kernels.small_m_bf16 import (
    Bf16Kernel,
    bf16_kernel_unavailable_reason,
    load_bf16_kernel,
)

__all__ = [
    "Bf16Kernel",
    "DecodeStack",
    "LinearKernel",
    "PrefillAttention",
    "RowKernel",
    "SmallMKernel",
    "bf16_kernel_unavailable_reason",
    "load_bf16_kernel",
    "load_decode_stack",
    "load_prefill_attention",
    "load_row_kernel",
    "load_small_m_kernel",
    "small_m_unavailable_reason",
]
