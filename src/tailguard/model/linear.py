"""The model's linears where plain `F.linear` is not the fastest: weights reordered once into
oneDNN's blocked layout (PackedLinear), or packed into one of our own kernels' panels
(KernelLinear). MistralModel.prepack swaps them in; both take [M, in] and give [M, out]."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tailguard.model.kernels import LinearKernel

__all__ = ["KernelLinear", "PackedLinear", "can_prepack"]


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """oneDNN-packed weights exist for CPU fp32/bf16 matmuls (not fp16, not CUDA); the bf16
    reorder also needs a CPU with oneDNN's bf16 support (AVX-512 or AVX-NE-CONVERT: on an
    AVX2-only CPU it raises), so bf16 weights stay plain there."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """A bias-free linear whose weight is reordered once into oneDNN's blocked layout.

    Why: `F.linear` hands oneDNN a plain [out, in] weight, which it reorders (re-reads and
    re-writes) on every call. Measured on the 2-core avx512_bf16 CPU, [8, 1024] x [1024, 5632]:
    1.23 -> 0.74 ms in bf16, 1.56 -> 0.81 ms in fp32; bf16 results are bit-identical, fp32
    differs by ~1e-6 (another summation order). The packed tensor replaces the plain weight.
    """

    def __init__(self, weight: Tensor, batch_hint: int = 8) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # the hint only tunes the layout; measured M-independent for bf16 (1..512 rows)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class KernelLinear(nn.Module):
    """A bias-free linear on one of our own kernels' weight layouts, run on the kernel for
    every row count: kernels/gemv.c (fp32) or kernels/gemv_bf16.c (bf16: vdpbf16ps, and AMX
    tiles where the CPU has them). One copy of the weight: the panels replace the plain
    [out, in] weight.

    Why: at decode sizes oneDNN's small-M kernels stream the weights at 50-75% of the read
    bandwidth; ours reach about all of it up to 8 rows and beat oneDNN up to 64
    (docs/benchmarks.md, issue 12, sessions 21, 30 and 31). Above that the work is compute-bound:
    fp32, per matmul from 10% faster to 23% slower than oneDNN in two noisy micro runs, and the
    246M model's 8 x 32-token prefill step the same (417-444 vs 378-427 ms); bf16 on Zen 4,
    equal at 256 rows (~425 GFLOP/s each); bf16 on a Xeon's AMX tiles, 0.9-1.1x oneDNN's AMX
    at 256-1024 rows (1.3-1.9 TFLOP/s). A batched matmul over the fp32 panels, the first
    dispatch above 64 rows, ran the embedded model's generation benchmark 10-13% slower.
    """

    def __init__(self, weight: Tensor, kernel: LinearKernel) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.kernel = kernel
        self.weight = kernel.pack(weight)  # [N/P, K, P] panels

    def forward(self, x: Tensor) -> Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.kernel.linear(x, self.weight)  # a clear ValueError for what it cannot read

    def fused(
        self,
        x: Tensor,
        *,
        silu: bool = False,
        norm: tuple[Tensor, float] | None = None,
        residual: Tensor | None = None,
    ) -> Tensor | None:
        """This linear with its decoder-layer neighbours in the kernel's own call where it has
        that path (the bf16 kernel on AMX above 32 rows; `LinearKernel.linear_fused`: norm
        (weight, eps) of x first, silu(gate) * up of the output, or + residual), else None."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.kernel.linear_fused(x, self.weight, silu=silu, norm=norm, residual=residual)
