"""Compiled kernels of our own, built at first use with the system C compiler."""

from tailguard.model.kernels.decode import DecodeStack, load_decode_stack
from tailguard.model.kernels.rows import RowKernel, load_row_kernel
from tailguard.model.kernels.small_m import (
    SmallMKernel,
    load_small_m_kernel,
    small_m_unavailable_reason,
)

__all__ = [
    "DecodeStack",
    "RowKernel",
    "SmallMKernel",
    "load_decode_stack",
    "load_row_kernel",
    "load_small_m_kernel",
    "small_m_unavailable_reason",
]
