"""Compiled kernels of our own, built at first use with the system C compiler."""

from tailguard.model.kernels.rows import RowKernel, load_row_kernel
from tailguard.model.kernels.small_m import (
    SmallMKernel,
    load_small_m_kernel,
    small_m_unavailable_reason,
)

__all__ = [
    "RowKernel",
    "SmallMKernel",
    "load_row_kernel",
    "load_small_m_kernel",
    "small_m_unavailable_reason",
]
