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


def architecture_table(archs) -> str:
    """The Markdown table (one row per ``conftest.Arch``), lines joined by newlines."""
    rows = []
    for a in archs:
        if a.refused:
            cells = (f"refused: {a.refused}", "—", "—", "—")
        elif a.seq2seq:
            cells = ("yes (encoder, decoder, cross)", a.swap, "no", a.masks)
        else:
            analysis = "yes (scores at the module's softmax)" if a.scores else "yes"
            swap = f"{a.swap} (softmax replaced)" if a.scores and a.swap == "yes" else a.swap
            values = f"yes ({a.values} projections)"
            if a.interface_from:  # the family moved to the AttentionInterface in that release
                since = f"; from transformers {a.interface_from}: "
                analysis, swap = f"{analysis[:-1]}{since}q and k)", f"{swap[:-1]}{since}the interface)"
                values = f"{values[:-1]}{since}traced)"
            cells = (analysis, swap, values, a.masks)
        rows.append(f"| {a.name} | `{a.key}` | " + " | ".join(cells) + " |")
    return "\n".join((*HEADER, *rows))


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from conftest import ARCHITECTURES

    print(architecture_table(ARCHITECTURES))


if __name__ == "__main__":
    main()
