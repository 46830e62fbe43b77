"""Fixed log-binned histograms: mergeable across ranks by addition, read back as quantiles.

|d| bins: bin 0 holds [0, 2**-30) (exact zeros included), then 16 bins per octave up to 2**12, then
one overflow bin. The bin of a value is read straight off its float32 bit pattern (exponent and top 4
mantissa bits), so binning costs one integer shift per token, and bin edges are exact.

Position bins (first-divergence positions): exact below 64, then 16 bins per octave.
"""

from __future__ import annotations

import numpy as np

_SUB_BITS = 4  # 16 sub-bins per octave
_SHIFT = 23 - _SUB_BITS  # float32 mantissa bits below the kept ones
_LO_EXP, _HI_EXP = -30, 12
_LO_CODE = (127 + _LO_EXP) << _SUB_BITS
_HI_CODE = (127 + _HI_EXP) << _SUB_BITS
NUM_ABS_BINS = _HI_CODE - _LO_CODE + 2

_POS_EXACT = 64
_POS_LO_CODE = (127 + 6) << _SUB_BITS  # code of 64.0
_POS_HI_CODE = (127 + 40) << _SUB_BITS
NUM_POS_BINS = _POS_EXACT + _POS_HI_CODE - _POS_LO_CODE + 1


def _code_value(code: np.ndarray) -> np.ndarray:
    """Lower edge of the float32 values whose top bits form `code`."""
    exp = (code >> _SUB_BITS).astype(np.float64) - 127.0
    frac = 1.0 + (code & ((1 << _SUB_BITS) - 1)).astype(np.float64) / (1 << _SUB_BITS)
    return np.ldexp(frac, exp.astype(np.int64))


# ABS_EDGES[j] is the lower edge of bin j; the last bin is open above.
ABS_EDGES = np.concatenate([[0.0], _code_value(np.arange(_LO_CODE, _HI_CODE + 1, dtype=np.int64))])
POS_EDGES = np.concatenate(
    [np.arange(_POS_EXACT, dtype=np.float64), _code_value(np.arange(_POS_LO_CODE, _POS_HI_CODE + 1, dtype=np.int64))]
)


def abs_histogram(abs_values: np.ndarray) -> np.ndarray:
    """(NUM_ABS_BINS,) int64 counts of non-negative finite values `abs_values` (M,)."""
    x = abs_values.astype(np.float32, copy=False)
    code = x.view(np.uint32) >> _SHIFT  # (M,) uint32: exponent and top mantissa bits, < 2**12
    counts = np.bincount(code, minlength=1 << (32 - _SHIFT))  # count every code, fold the tails after
    hist = np.empty(NUM_ABS_BINS, dtype=np.int64)
    hist[0] = counts[:_LO_CODE].sum()  # below 2**-30, zeros included
    hist[1:-1] = counts[_LO_CODE:_HI_CODE]
    hist[-1] = counts[_HI_CODE:].sum()  # 2**12 and above
    return hist


def position_histogram(positions: np.ndarray) -> np.ndarray:
    """(NUM_POS_BINS,) int64 counts of non-negative integer positions."""
    pos = np.asarray(positions, dtype=np.int64)
    # Exponent and top mantissa bits of the exact float64 value, re-biased to float32 codes (a float32
    # would round 2**33 - 1 up to 2**33, one bin too high, for any position past 2**24).
    code = (pos.astype(np.float64).view(np.int64) >> (52 - _SUB_BITS)) - ((1023 - 127) << _SUB_BITS)
    big = np.clip(code, _POS_LO_CODE, _POS_HI_CODE) - _POS_LO_CODE + _POS_EXACT
    idx = np.where(pos < _POS_EXACT, pos, big)
    return np.bincount(idx, minlength=NUM_POS_BINS).astype(np.int64)


def quantile(hist: np.ndarray, edges: np.ndarray, q: float, upper: float) -> float:
    """The q-quantile (0 < q < 1) of the values counted in `hist`, interpolated linearly inside its
    bin; `upper` (the exact maximum) closes the last occupied bin and caps the answer."""
    total = int(hist.sum())
    if total == 0:
        return 0.0
    cum = np.cumsum(hist)
    target = q * total
    j = int(np.searchsorted(cum, target, side="left"))
    lo = float(edges[j])
    hi = float(edges[j + 1]) if j + 1 < len(edges) else upper
    hi = min(hi, upper)
    below = float(cum[j] - hist[j])
    frac = (target - below) / float(hist[j])
    return float(min(max(lo + frac * (hi - lo), 0.0), upper))


def position_quantile(hist: np.ndarray, q: float) -> int:
    """Lower edge of the position bin holding the q-quantile (exact for positions below 64)."""
    cum = np.cumsum(hist)
    j = int(np.searchsorted(cum, q * int(hist.sum()), side="left"))
    return int(POS_EDGES[j])
