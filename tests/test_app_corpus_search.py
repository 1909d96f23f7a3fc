"""Inspect's "Find similar tokens in a corpus run" (issue 30 item 14, AppTest): a finished corpus run
of the embedded MiniLM with a token index, one of whose documents is the page's sample text in one
window, so the focused token's own row is in the index with the same hidden state and masses."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("streamlit.testing.v1")
import test_app_issue30 as base  # noqa: E402

app_env = base.app_env
messages, run_page = base.messages, base.run_page
pytestmark = pytest.mark.slow  # a small corpus run (MiniLM) and Inspect


@pytest.fixture(scope="module")
def indexed_run(tmp_path_factory):
    """result/ of a finished corpus run with an index: the sample text and another document."""
    import sys

    sys.path.insert(0, str(base.REPO / "app"))
    from appkit.controls import SAMPLE

    from attnlab.corpus import analyze_corpus

    tmp = tmp_path_factory.mktemp("search-run")
    (tmp / "docs").mkdir()
    (tmp / "docs" / "a.txt").write_text(SAMPLE)
    (tmp / "docs" / "b.txt").write_text("The dog sat by the door. A cat looked at the mat and sat on it.")
    analyze_corpus(str(tmp / "docs"), out=tmp / "result", variants=["unas", "dnas"], window=64, bootstrap=20,
                   index=True)
    return tmp / "result"


def _install(app_env, result, **manifest_changes):
    run = app_env / "runs" / "corpus" / "demo"
    run.mkdir(parents=True)
    (run / "app_corpus.json").write_text("{}")
    shutil.copytree(result, run / "result")
    if manifest_changes:
        path = run / "result" / "manifest.json"
        manifest = json.loads(path.read_text())
        for key, value in manifest_changes.items():
            manifest[key] = {**manifest[key], **value}
        path.write_text(json.dumps(manifest))


def _tables(at) -> list:
    """The corpus search's result tables on the page (the only tables with a context column)."""
    return [d.value for d in at.dataframe if "context" in d.value.columns]


def _results(at):
    (table,) = _tables(at)
    return table


@pytest.mark.parametrize("by", ["embedding", "mass"])
def test_the_focused_token_finds_itself_first_in_the_corpus_run(app_env, indexed_run, by):
    _install(app_env, indexed_run)
    at = run_page(focus="3")  # 3: "sat" of the sample text
    at.toggle(key="inspect_corpus_search").set_value(True).run()
    at.radio(key="inspect_search_by").set_value(by).run()
    at.number_input(key="inspect_search_k").set_value(5).run()
    assert not at.exception, [e.message for e in at.exception]
    table = _results(at)
    assert len(table) == 5 and list(table.columns[:4]) == ["similarity", "document", "token #", "token"]
    top = table.iloc[0]
    assert (top["document"], top["token #"], top["token"], top["position"]) == ("a.txt", 2, "sat", 3)
    assert top["similarity"] > 0.999 and "The cat ⟦sat⟧ on the mat" in top["context"]
    assert (table["similarity"].diff().dropna() <= 0).all()
    assert "sat" in set(table["token"][1:])  # the other document's "sat"s are near
    assert "nearest to **3: sat**" in " ".join(c.value for c in at.caption)


def test_a_run_of_another_model_or_variant_is_refused_with_a_message(app_env, indexed_run):
    _install(app_env, indexed_run, model={"name": "other-model", "path": "/elsewhere"})
    at = run_page(focus="3")
    at.toggle(key="inspect_corpus_search").set_value(True).run()
    assert "analysed with 'other-model'" in messages(at) and "cannot be compared" in messages(at)
    assert not _tables(at)


def test_a_mass_search_needs_the_index_variant_and_nothing_is_listed_without_a_run(app_env, indexed_run):
    at = run_page(focus="3")
    at.toggle(key="inspect_corpus_search").set_value(True).run()
    assert "No finished corpus run of this server has a token index" in messages(at)
    _install(app_env, indexed_run)
    at = run_page(focus="3", variants="dnas")
    at.toggle(key="inspect_corpus_search").set_value(True).run()
    at.radio(key="inspect_search_by").set_value("mass").run()
    assert "under unas, which this page does not analyse" in messages(at)
    at.radio(key="inspect_search_by").set_value("embedding").run()
    assert _results(at).iloc[0]["token"] == "sat"


def test_the_corpus_page_asks_for_the_index(app_env):
    """The Corpus page's "Token index for search" (on by default) adds --index to the command."""
    from appkit.corpus_runs import command

    assert "--index" in command(app_env, {"index": True}, "kjv")
    assert "--index" not in command(app_env, {"index": False}, "kjv")
    at = run_page("corpus")
    assert at.checkbox(key="corpus_index").value is True
