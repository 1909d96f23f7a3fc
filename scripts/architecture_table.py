"""Print the table of architectures of docs/ANALYSIS.md §9 from the list tests/test_architectures.py
tests (``ARCHITECTURES`` in tests/conftest.py): ``python scripts/architecture_table.py``.

tests/test_architectures.py checks that the table in the doc is this script's output, so the two
cannot drift; every "yes" is a test of that module on a tiny random model of the architecture.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"

HEADER = (
    "| Architecture | model_type | Analysis (recompute) | Swap | Contributions | Masks, windows, softcap |",
    "| --- | --- | --- | --- | --- | --- |",
)


def _noted(word: str, notes: list[str]) -> str:
    """``word (note; note)``, or ``word`` alone."""
    return f"{word} ({'; '.join(notes)})" if notes else word


def architecture_table(archs) -> str:
    """The Markdown table (one row per ``conftest.Arch``), lines joined by newlines."""
    rows = []
    for a in archs:
        if a.refused:
            cells = (f"refused: {a.refused}", "—", "—", "—")
        elif a.seq2seq:
            cells = ("yes (encoder, decoder, cross)", a.swap, "no", a.masks)
        else:
            analysis = ["scores at the module's softmax"] if a.scores else []
            swap = ["softmax replaced"] if a.scores and a.swap == "yes" else []
            values = [f"{a.values} projections"]
            if a.interface_from:  # the family moved to the AttentionInterface in that release
                since = f"from transformers {a.interface_from}: "
                analysis.append(since + "q and k"), swap.append(since + "the interface")
                values.append(since + "traced")
            cells = (_noted("yes", analysis), _noted(a.swap, swap), _noted("yes", values), a.masks)
        rows.append(f"| {a.name} | `{a.key}` | " + " | ".join(cells) + " |")
    return "\n".join((*HEADER, *rows))


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from conftest import ARCHITECTURES

    print(architecture_table(ARCHITECTURES))


if __name__ == "__main__":
    main()
