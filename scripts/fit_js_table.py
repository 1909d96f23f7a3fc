"""Fit the table of attnlab's analysis kernel for the Jensen-Shannon terms (attnlab/csrc/analysis_vec.h,
``kChiTable``) and print it as C++.

The kernel needs, for a weight p = q x of a variant against the unas weight q with ln x known from the
variants' factors, the term p ln(2p / (p + q)) + q ln(2q / (p + q)) = (p + q) chi(ln x) / 2 with

    chi(t) = t tanh(t / 2) - 2 ln cosh(t / 2) = (1 + d) ln(1 + d) + (1 - d) ln(1 - d),  d = tanh(t / 2),

even in t, t^2 / 4 near 0, 2 ln 2 as |t| grows. The table holds g(t) = chi(t) / (2 t^2) on 32
intervals of |t| in [0, 24), 0.75 wide, each as a degree-5 polynomial in the position u in [0, 1)
within its interval (so chi keeps its relative accuracy for close rows): Chebyshev interpolation of g
computed in 40-digit arithmetic (mpmath), converted to powers of u, rounded to float32. The script
then evaluates the table as the kernel does (float32 Horner, times a^2) on a dense grid and prints the
largest relative error of chi. Beyond |t| = 24 the kernel uses chi = 2 ln 2 (relative error 1.4e-9).

    python scripts/fit_js_table.py            # prints the C++ rows and the error
"""

import mpmath
import numpy as np
from numpy.polynomial import chebyshev, polynomial

INTERVALS, WIDTH, DEGREE = 32, 0.75, 5
mpmath.mp.dps = 40


def half_g(t: float) -> float:
    """chi(t) / (2 t^2) in 40 digits, rounded to float64."""
    t = mpmath.mpf(t)
    if t == 0:
        return 0.125
    return float((t * mpmath.tanh(t / 2) - 2 * mpmath.log(mpmath.cosh(t / 2))) / (2 * t * t))


def fit() -> np.ndarray:
    """(DEGREE + 1, INTERVALS) float32: row n holds the coefficients of u^n, interval by interval."""
    nodes = 0.5 - 0.5 * np.cos(np.pi * (np.arange(200) + 0.5) / 200)  # u in (0, 1), Chebyshev points
    table = np.zeros((DEGREE + 1, INTERVALS))
    for i in range(INTERVALS):
        values = np.array([half_g(i * WIDTH + WIDTH * u) for u in nodes])
        in_s = chebyshev.cheb2poly(chebyshev.chebfit(2 * nodes - 1, values, DEGREE))  # powers of s = 2u - 1
        in_u = np.zeros(1)
        for n, c in enumerate(in_s):
            in_u = polynomial.polyadd(in_u, c * polynomial.polypow([-1.0, 2.0], n))
        table[:, i] = in_u
    return table.astype(np.float32)


def max_relative_error(table: np.ndarray) -> float:
    """Largest relative error of chi from the table, evaluated as the kernel does, over [0, 24)."""
    a = np.concatenate([np.linspace(0, INTERVALS * WIDTH, 20_001)[:-1], np.geomspace(1e-8, 1, 2_000)])
    a32 = a.astype(np.float32)
    y = a32 * np.float32(1 / WIDTH)
    idx = np.minimum(y.astype(np.int32), INTERVALS - 1)
    u = (y - idx.astype(np.float32)).astype(np.float32)
    g = table[DEGREE, idx]
    for n in range(DEGREE - 1, -1, -1):
        g = (g * u + table[n, idx]).astype(np.float32)
    got = (a32 * a32 * g).astype(np.float64) * 2
    ref = np.array([2 * half_g(float(x)) * float(x) ** 2 for x in a32.astype(np.float64)])
    ok = ref > 0
    return float(np.max(np.abs(got[ok] - ref[ok]) / ref[ok]))


def main() -> None:
    table = fit()
    for row in table:
        print("    {" + ", ".join(f"{v:.9e}f" for v in row) + "},")
    print(f"// max relative error of chi: {max_relative_error(table):.2e}")


if __name__ == "__main__":
    main()
