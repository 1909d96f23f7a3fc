"""One sidebar widget per registered variant parameter (``attnlab.Param``: default, bounds, help),
whose value and the URL's always agree with what the analysis uses.

- a bounded int with at most 100 values: a slider; a wider int range (Sinkhorn ``iters``, 1-10,000) or
  an unbounded number: a number box without browser-side bounds, checked here, so an out-of-range value
  is refused with a message naming the bounds (the browser's own bounds only outlined it in red, while
  the analysis and the URL silently kept the previous value);
- a parameter whose useful values span decades (``tol``): a select slider of powers of ten;
- a bounded float: a slider; HNAS ``u`` is disabled, with a note, for a checkpoint that learned its own.
"""

from __future__ import annotations

import streamlit as st

from appkit import state
from appkit.variants import param_specs, variant_label

SLIDER_MAX_VALUES = 100  # an int range with more values gets a number box
LOG_CHOICES = {"tol": (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)}  # parameters on a log scale
LEARNED_U = "This checkpoint's learned u (per layer and head) is used; the slider applies to other models."


def _in_range(p, v) -> bool:
    return (p.low is None or v >= p.low) and (p.high is None or v <= p.high)


def _is_number(p):
    def ok(v) -> bool:
        try:
            return float(v) == p.kind(v)
        except (TypeError, ValueError, OverflowError):
            return False

    return ok


def _bounds(p) -> str:
    fmt = "{:,}" if p.kind is int else "{:g}"
    low = "" if p.low is None else fmt.format(p.low)
    high = "" if p.high is None else fmt.format(p.high)
    if low and high:
        return f"from {low} to {high}"
    return f"at least {low}" if low else f"at most {high}"


def param_widget(prefix: str, variant: str, p, *, learned_u: bool = False) -> tuple[object, str | None]:
    """The widget of one parameter (key and URL name ``{variant}_{param}``) -> (value, None), or
    (value, message) when the value is out of the parameter's bounds (the page stops there)."""
    name, label = f"{variant}_{p.name}", f"{variant_label(variant)} {p.name}"
    url = state.INT if p.kind is int else state.FLOAT
    bounded = p.low is not None and p.high is not None
    if p.name in LOG_CHOICES:
        choices = [c for c in LOG_CHOICES[p.name] if _in_range(p, c)]
        value = state.remembered(
            prefix, name, st.select_slider, p.default, label, choices, help=p.help, url=url,
            valid=choices.__contains__, format_func=lambda c: "0 (off)" if c == 0 else f"{c:g}",
        )
        return value, None
    if bounded and (p.kind is float or p.high - p.low <= SLIDER_MAX_VALUES):
        lo, hi = p.kind(p.low), p.kind(p.high)
        step = 1 if p.kind is int else (hi - lo) / 20
        disabled = learned_u and p.name == "u"
        value = state.remembered(
            prefix, name, st.slider, p.kind(p.default), label, lo, hi, step=step, help=p.help, url=url,
            valid=lambda v: _is_number(p)(v) and _in_range(p, v), disabled=disabled,
        )
        if disabled:
            st.caption(LEARNED_U)
        return value, None
    value = state.remembered(
        prefix, name, st.number_input, p.kind(p.default), label, step=1 if p.kind is int else None,
        help=f"{p.help} ({_bounds(p)})", url=url, valid=_is_number(p),
    )
    if not _in_range(p, value):
        return value, f"{label} must be {_bounds(p)}, got {value:,}: change it to see the analysis."
    return value, None


def param_widgets(prefix: str, chosen, *, learned_u: bool = False) -> tuple[dict, str | None]:
    """The widgets of the chosen variants' parameters -> ({name: value}, first problem or None)."""
    values, problems = {}, []
    for variant, p in param_specs():
        if variant in chosen:
            values[p.name], problem = param_widget(prefix, variant, p, learned_u=learned_u)
            problems += [problem] if problem else []
    return values, (problems[0] if problems else None)
