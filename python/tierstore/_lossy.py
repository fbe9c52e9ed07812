"""Lossy modes of the codec: opt-in per tensor class, never the default.

Mantissa rounding keeps ``k`` bits of each float's mantissa (round half to
even on the bit pattern), so the low bytes of every element become zero and
the byte planes that held noise compress. The relative error of each
element is at most ``2**-(k + 1)``; it is measured on every write (the
largest relative error over the finite, nonzero, normal elements) and
recorded in the record's manifest entry. Zeros, subnormals, infinities and
NaNs are kept as they are, and so is a value that rounding would carry past
the largest finite number (the bound holds for every element).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierstore._metadata import dtype_name
from tierstore.errors import InvalidArgumentError, TierstoreError

#: Mantissa bits of each float type the rounding handles.
MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_BITS = {torch.float64: 64, torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}


def check_keep_bits(keep_bits: Any) -> dict[str, int]:
    """``{tensor class: bits}``: a class is a key name in a tensor's path
    (``"exp_avg_sq"``), ``"*"`` for every float tensor."""
    if keep_bits is None:
        return {}
    if not isinstance(keep_bits, Mapping):
        raise InvalidArgumentError(f"keep_bits must map tensor classes to bit counts, got {type(keep_bits).__name__}")
    out: dict[str, int] = {}
    for cls, k in keep_bits.items():
        if not isinstance(cls, str) or not cls:
            raise InvalidArgumentError(f"keep_bits: a tensor class is a non-empty key name, got {cls!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 52:
            raise InvalidArgumentError(f"keep_bits[{cls!r}]: mantissa bits must be an integer from 1 to 52, got {k!r}")
        out[cls] = k
    return out


def bits_for_bounds(max_rel_error: Any) -> dict[str, int]:
    """``{tensor class: relative error bound}`` as mantissa bits to keep:
    the fewest ``k`` with ``2**-(k+1)`` at most the bound (the bound each
    write then verifies and records)."""
    if max_rel_error is None:
        return {}
    if not isinstance(max_rel_error, Mapping):
        raise InvalidArgumentError(
            f"max_rel_error must map tensor classes to relative error bounds, got {type(max_rel_error).__name__}"
        )
    import math

    out: dict[str, int] = {}
    for cls, b in max_rel_error.items():
        ok = isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and 0 < b < 1
        if not isinstance(cls, str) or not cls or not ok:
            raise InvalidArgumentError(
                f"max_rel_error[{cls!r}]: a relative error bound is a number between 0 and 1, got {b!r}"
            )
        k = max(1, math.ceil(-math.log2(b)) - 1)
        if k > 52:
            raise InvalidArgumentError(
                f"max_rel_error[{cls!r}] = {b!r}: below what float64 represents (its rounding error is 2**-53)"
            )
        out[cls] = k
    return out


def bits_for(paths: Sequence[tuple[Any, ...]], keep_bits: Mapping[str, int]) -> int | None:
    """The bits kept for a storage viewed at ``paths`` (the fewest any of
    its classes asks for), None when it stays lossless."""
    got = [k for p in paths for cls, k in keep_bits.items() if cls == "*" or cls in p]
    return min(got) if got else None


def round_mantissa(t: torch.Tensor, k: int, what: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """``t`` (a flat float tensor) with ``k`` mantissa bits kept, and the
    manifest's record of it; raises when the bound does not hold."""
    m = MANTISSA.get(t.dtype)
    if m is None:
        raise InvalidArgumentError(
            f"{what}: mantissa rounding applies to float16, bfloat16, float32 and float64, not {t.dtype}"
        )
    if k > m:
        name = dtype_name(t.dtype)
        raise InvalidArgumentError(
            f"{what}: keep_bits {k} (a relative error bound of {2.0 ** -(k + 1):.3g}) is more than the {m} mantissa "
            f"bits {name} has; a bound that tight is below what {name} represents (its own rounding error is "
            f"{2.0 ** -(m + 1):.3g}; use {m} bits or fewer, a bound of {2.0 ** -(m + 1):.3g} or more)"
        )
    bound = 2.0 ** -(k + 1)
    info = {"mode": "keep_bits", "keep_bits": k, "bound": bound}
    drop = m - k
    if drop == 0:
        return t, {**info, "max_rel_error": 0.0}
    itype, nbits = _INT[t.dtype], _BITS[t.dtype]
    x = t.contiguous().view(itype)
    sign_mask = -(1 << (nbits - 1))  # the sign bit, as a signed integer of that width
    mag = x & ~torch.tensor(sign_mask, dtype=itype)
    sign = x & torch.tensor(sign_mask, dtype=itype)
    exp = mag >> m
    emax = (1 << (nbits - 1 - m)) - 1
    lsb = (mag >> drop) & 1
    rounded = (mag + ((1 << (drop - 1)) - 1) + lsb) & ~torch.tensor((1 << drop) - 1, dtype=itype)
    keep = (exp == 0) | (exp == emax) | ((rounded >> m) == emax)  # subnormal, inf/nan, would overflow
    out = torch.where(keep, x, sign | rounded).view(t.dtype)
    # The bound, measured (in float64) over the elements rounding touched.
    changed = ~keep
    if bool(changed.any()):
        a = t.view(-1)[changed.view(-1)].double()
        b = out.view(-1)[changed.view(-1)].double()
        nz = a != 0
        err = float(((b[nz] - a[nz]).abs() / a[nz].abs()).max()) if bool(nz.any()) else 0.0
    else:
        err = 0.0
    if err > bound:
        raise TierstoreError(
            f"{what}: mantissa rounding to {k} bits made a relative error of {err:.3g}, over its bound {bound:.3g}"
        )
    return out, {**info, "max_rel_error": err}
