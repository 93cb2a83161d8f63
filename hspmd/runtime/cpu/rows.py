"""Rows in blocks and in parallel: a large row-wise kernel run on blocks of rows, on threads.

A large row-wise kernel (a ufunc, or one marked `rowwise = True`: elementwise, or reducing
along the last dim only) runs on blocks of rows small enough for the caches (its temporaries
too), the blocks spread over `threads` threads; one marked `row_parallel = True` (rows along
dim 0 independent) runs on `threads` blocks of rows. NumPy releases the GIL, and every
element is computed as it would be in one call (same bits). (Matmuls keep BLAS's own
threads: NumPy's batched matmul split over Python threads measured slower than BLAS's
threads inside each product.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: results of at least this many bytes are computed by rows on several threads
ROW_PARALLEL_BYTES = 1 << 20
#: a row-wise kernel works on blocks of about this many result elements (stays in cache)
ROW_BLOCK_ELEMENTS = 1 << 15


def by_rows_or_blocks(kernel: Callable, operand_types: list, result_types: list, threads: int) -> Callable:
    """Return `kernel` (an `out=` kernel whose first result has `ROW_PARALLEL_BYTES` or more)
    run by blocks of rows where it can be, else `kernel` itself."""
    return (_rowwise(kernel, operand_types, result_types, threads)
            or (_by_rows(kernel, operand_types, result_types[0], threads)
                if threads > 1 and len(result_types) == 1 else None)
            or kernel)


_POOL = None


def _pool(threads: int):
    """Return the process's thread pool for row blocks (grown to `threads - 1` workers)."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="hspmd-rows")
    return _POOL


def _by_rows(kernel: Callable, operand_types: list, result_type, threads: int) -> Callable | None:
    """Return `kernel` run on `threads` blocks of rows (dim 0) of its `out=`, or None if it cannot be.

    An operand of the result's rank and leading extent is cut into the same rows; one of lower
    rank or with a leading extent of 1 broadcasts, and is passed whole; any other shape keeps
    the kernel whole.
    """
    if not (getattr(kernel, "row_parallel", False) is True
            or isinstance(kernel, np.ufunc) and kernel.nout == 1 and kernel.nin == len(operand_types)):
        return None
    shape = result_type[0]
    if len(shape) < 1 or shape[0] < threads:
        return None
    cut = []
    for t in operand_types:
        if t is None:
            return None
        if len(t[0]) == len(shape) and t[0][0] == shape[0]:
            cut.append(True)
        elif len(t[0]) < len(shape) or t[0][0] == 1:
            cut.append(False)
        else:
            return None
    step = -(-shape[0] // threads)
    blocks = [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]
    pool = _pool(threads)

    def by_rows(*args, out):
        def part(lo: int, hi: int):
            return kernel(*[a[lo:hi] if c else a for a, c in zip(args, cut)], out=out[lo:hi])

        _run_spans(pool, part, blocks)
        return out

    by_rows.__name__ = getattr(kernel, "__name__", "kernel")
    by_rows.rows_of = kernel  # type: ignore[attr-defined]
    return by_rows


def _run_spans(pool, part, spans) -> None:
    """Run `part(lo, hi)` for every span: the first on this thread, the others on `pool` (None: none)."""
    futures = [pool.submit(part, lo, hi) for lo, hi in spans[1:]] if pool is not None else []
    part(*spans[0])
    for f in futures:
        f.result()


def _as_rows(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Return a view of `a` as [rows, cols]; AttributeError if that needs a copy."""
    v = a.view()
    v.shape = (rows, cols)
    return v


def _rowwise(kernel: Callable, operand_types: list, result_types: list, threads: int) -> Callable | None:
    """Return `kernel` run by cache-sized blocks of rows (all leading dims merged), spread over
    `threads` threads; None unless the kernel is row-wise (a ufunc, or marked `rowwise = True`).

    An operand with the results' leading dims is cut into the same rows; one of rank <= 1
    broadcasts along rows and is passed whole. An operand that cannot be viewed as rows
    without a copy (a transposed view, say) makes that call run whole.
    """
    if not (getattr(kernel, "rowwise", False) is True
            or isinstance(kernel, np.ufunc) and kernel.nout == 1 and kernel.nin == len(operand_types)):
        return None
    shape = result_types[0][0]
    if any(t is None or t[0] != shape for t in result_types) or not shape:
        return None
    lead, last = (shape[:-1], shape[-1]) if len(shape) > 1 else (shape, 1)
    rows = int(np.prod(lead, dtype=np.int64))
    cols: list[int | None] = []
    for t in operand_types:
        if t is None:
            return None
        s = t[0]
        if len(s) == len(shape) and (s[:-1] == lead if len(shape) > 1 else s == shape):
            cols.append(s[-1] if len(shape) > 1 else 1)
        elif len(s) == 0 or len(shape) > 1 and len(s) == 1:
            cols.append(None)
        else:
            return None
    per_block = max(1, ROW_BLOCK_ELEMENTS // last)
    per_thread = -(-rows // threads)
    spans = [(lo, min(lo + per_thread, rows)) for lo in range(0, rows, per_thread)]
    pool = _pool(threads) if len(spans) > 1 else None
    single = len(result_types) == 1

    def by_blocks(*args, out):
        try:
            views = [a if c is None else _as_rows(a, rows, c) for a, c in zip(args, cols)]
            outs = [_as_rows(o, rows, last) for o in ((out,) if single else out)]
        except AttributeError:  # an operand is not a view of rows: one call on the whole
            return kernel(*args, out=out)

        def part(lo: int, hi: int) -> None:
            for b in range(lo, hi, per_block):
                e = min(b + per_block, hi)
                block_out = outs[0][b:e] if single else tuple(o[b:e] for o in outs)
                kernel(*[v if c is None else v[b:e] for v, c in zip(views, cols)], out=block_out)

        _run_spans(pool, part, spans)
        return out

    by_blocks.__name__ = getattr(kernel, "__name__", "kernel")
    by_blocks.rows_of = kernel  # type: ignore[attr-defined]
    return by_blocks

