"""Cross-attention's line views (an encoder-decoder's M target queries x N source keys) as the
library's figures: ``figures.build`` passes both token lists to the head view, the head overlay and
the model view; the focus is a key (a source token): its lines, and its label alone, are focused."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.figures import kinds

QUERIES = ["<s>", "A", "key"]  # M = 3 target tokens
KEYS = ["<s>", "Attention", "lets", "every", "</s>"]  # N = 5 source tokens
FADED = 0.12 + 1e-9  # the unfocused lines' opacity is scaled by 0.12 (attnlab.figures.head_view)


def _weights(seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).random((2, 4, 3, 5)).astype(np.float32)  # (L, H, M, N)
    return w / w.sum(-1, keepdims=True)


def _markers(fig):
    """(query labels, key labels, their label colours) of a head view: its last two traces."""
    q, k = fig.data[-2], fig.data[-1]
    return list(q.text), list(k.text), list(q.textfont.color), list(k.textfont.color)


@pytest.mark.parametrize("heads", [None, [1, 3]])
def test_head_view_takes_target_queries_and_source_keys(heads):
    w = _weights()
    params = {"variant": "dnas", "layer": 1, "head": 1, "focus": 4, "heads": heads, "min_weight": 0.0}
    b = kinds.build("head_view", {"dnas": w}, KEYS, params, query_tokens=QUERIES)
    queries, keys, q_colour, k_colour = _markers(b.figure)
    assert queries == QUERIES and keys == KEYS
    assert k_colour[4] != "#222" and set(q_colour) == {"#222"}, "the focus is a key: its label alone"
    assert b.arrays["query_tokens"].tolist() == QUERIES and b.arrays["tokens"].tolist() == KEYS
    if heads is None:
        np.testing.assert_array_equal(b.arrays["dnas"], w[1, 1])  # (M, N)
    else:
        np.testing.assert_array_equal(b.arrays["dnas"], w[1, heads])  # (h, M, N)
    strong = [t for t in b.figure.data[:-2] if t.opacity is not None and t.opacity > FADED]
    lines = np.concatenate([np.asarray(t.y, dtype=float).reshape(-1, 3) for t in strong])  # (query, key, NaN)
    assert set(lines[:, 1].tolist()) == {4.0}, "every line drawn at full strength ends at the focused key"
    assert set(lines[:, 0].tolist()) == {0.0, 1.0, 2.0}, "from every target query"


def test_model_view_takes_both_lists_and_refuses_a_query_focus_range():
    w = _weights(1)
    b = kinds.build("model_view", {"unas": w}, KEYS, {"variant": "unas", "focus": 2}, query_tokens=QUERIES)
    markers = b.figure.data[-1]  # one per (layer, head, key): the focusable side
    assert len(markers.x) == 2 * 4 * len(KEYS)
    assert set(np.asarray(markers.x) % 3) == {1.0}, "on the key side"
    assert b.arrays["query_tokens"].tolist() == QUERIES
    assert "focus: 2: lets" in b.figure.layout.title.text
    with pytest.raises(ValueError, match=r"focus must be a token position in \[0, 5\), got 5"):
        kinds.build("model_view", {"unas": w}, KEYS, {"variant": "unas", "focus": 5}, query_tokens=QUERIES)
    with pytest.raises(ValueError, match=r"model_view needs self-attention \(M == N\) or query_tokens"):
        kinds.build("model_view", {"unas": w}, KEYS, {"variant": "unas"})
    with pytest.raises(ValueError, match=r"attention has 3 positions, while query_tokens has 2 tokens"):
        kinds.build("head_view", {"unas": w}, KEYS, {"variant": "unas", "layer": 0, "head": 0},
                    query_tokens=QUERIES[:2])
    with pytest.raises(ValueError, match=r"token_mass draws self-attention: query_tokens"):
        kinds.build("token_mass", {"unas": w}, KEYS, {"variant": "unas", "layer": 0, "head": 0},
                    query_tokens=QUERIES)
