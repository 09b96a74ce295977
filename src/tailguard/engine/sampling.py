"""Sampling a step's next tokens: every sampled row at once, one uniform draw per row.

`torch.multinomial` on one 32,000-wide row costs ~0.8 ms on this project's CPUs (it prepares
the whole distribution for each call), so sampling row by row cost 1.7 ms per sequence in a
decode step: more than the forward's share of a sequence on the embedded model, and the
largest per-sequence term in the step cost admission predicts. Here the rows are sampled
together by inverse CDF: softmax at each row's temperature, a cumulative sum (float64, so the
last of 32,000 probabilities keeps its weight), and one uniform per row located with
`searchsorted`. That is exact sampling from the same distribution, at ~0.1 ms per row.

Top-p (nucleus) rows are sorted first and their tail zeroed before the cumulative sum; the
best token is always kept. A request with its own seed draws its uniform from its own
generator, so its tokens do not depend on what else shares the step; the others share the
engine's generator (seeded by the engine's `seed`).

With the row kernels (model/kernels/rows.c) on CPU, the rows without top-p are sampled by the
same inverse CDF in one pass of our own (~17 us a row against ~120 for the torch ops above on
44 rows of 32,000), and greedy rows take its argmax (torch's is not vectorised: 2.5 ms for 44
rows, 0.3 with the kernel). The uniforms come from the same generators either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tailguard.model.kernels import RowKernel

__all__ = ["greedy_rows", "sample_rows"]


def _kernel_ok(logits: torch.Tensor, kernel: RowKernel | None) -> RowKernel | None:
    if kernel is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    return kernel if logits.dim() == 2 and logits.stride(1) == 1 else None


def greedy_rows(
    logits: torch.Tensor, rows: Sequence[int], kernel: RowKernel | None = None, threads: int = 1
) -> list[int]:
    """The argmax of each of `rows` of `logits` [R, vocab] (the first maximal id)."""
    if not rows:
        return []
    k = _kernel_ok(logits, kernel)
    if k is not None:
        return k.argmax(logits, rows, threads)
    # every row's argmax, then the wanted ones on the host: no [rows, vocab] gather whose size
    # follows the batch (on CUDA a size the caching allocator may not hold; engine/runner.py)
    picks = logits.argmax(dim=-1).tolist()
    return [picks[r] for r in rows]


def sample_rows(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
    *,
    rows: Sequence[int] | None = None,
    kernel: RowKernel | None = None,
    threads: int = 1,
) -> list[int]:
    """One token id per row of `logits` [R, vocab] (or per row of `rows`, indices into it):
    the i-th at `temperatures[i]` (> 0) and `top_ps[i]`, its uniform drawn from
    `generators[i]`, or from `shared` where that is None."""
    index = list(range(logits.shape[0])) if rows is None else list(rows)
    if not index:
        return []
    u = _uniforms(len(index), generators, shared, logits.device)
    k = _kernel_ok(logits, kernel)
    if k is None:
        return _inverse_cdf(logits if rows is None else logits[index], temperatures, top_ps, u)
    plain = [i for i, p in enumerate(top_ps) if p >= 1.0]
    picks = [0] * len(index)
    if plain:
        got = k.sample(
            logits, [index[i] for i in plain], [temperatures[i] for i in plain], u[plain], threads
        )
        for i, t in zip(plain, got, strict=True):
            picks[i] = t
    nucleus = [i for i, p in enumerate(top_ps) if p < 1.0]
    if nucleus:
        got = _inverse_cdf(
            logits[[index[i] for i in nucleus]],
            [temperatures[i] for i in nucleus],
            [top_ps[i] for i in nucleus],
            u[nucleus],
        )
        for i, t in zip(nucleus, got, strict=True):
            picks[i] = t
    return picks


def _inverse_cdf(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    u: torch.Tensor,
) -> list[int]:
    """The torch path: every row of `logits`, row i with uniform u[i]."""
    temp = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    probs = torch.softmax(logits.float() / temp.unsqueeze(1), dim=-1)
    order: torch.Tensor | None = None
    nucleus = [i for i, p in enumerate(top_ps) if p < 1.0]
    if nucleus:
        probs, order = probs.sort(dim=-1, descending=True)
        top_p = torch.tensor(top_ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
        # keep a token while the mass before it is under top_p: the best one always stays
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    # below the total even where u * total rounds up to it: never past the last kept token
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    picks = torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1)
    if order is not None:
        picks = order.gather(1, picks.unsqueeze(1)).squeeze(1)
    return [int(t) for t in picks.tolist()]


def _uniforms(
    rows: int,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """A uniform in [0, 1) per row: the shared generator's in one draw, each seeded row's from
    its own generator."""
    u = torch.rand(rows, generator=shared, dtype=torch.float64, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            u[i] = torch.rand(1, generator=gen, dtype=torch.float64, device=device)[0]
    return u
