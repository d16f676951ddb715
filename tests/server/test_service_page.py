"""The page at `/` in a real headless Chromium (Debian's, driven over the DevTools protocol) against a real server
on 127.0.0.1 over the bundled example index: asked with the keyboard only, the streamed answer equals `/v1/ask`'s,
the sources and the cache numbers are shown, the side-by-side answer equals `full`'s, a document whose text is
markup is shown as text and never runs, the page fits 320 px, light and dark. Screenshots are saved as artefacts
(the paths are printed). One browser and one server for the module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from hypic_rag.demo.default_model import default_model_path, example_corpus_path
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import build_index
from kits.browser import Browser, chromium_missing
from kits.service_page import PICTURE_QUESTION, ask_on_page, card, shown_answer

MISSING = chromium_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"no headless browser: {MISSING}")

ASK = {"top_k": 4, "max_new_tokens": 48, "temperature": 0}
"""What the page sends by default (besides the question, the mode and `stream`)."""
MARKUP_ID = "<img src=x onerror=window.__pwned=3>.md"
MARKUP_TEXT = ("<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\"> The Zorblat quartz mine of "
               "Vexhollow is run by <b>Quillon Brask</b>, who ships its quartz down the Vexhollow river.")
INDEX_LOADED = "document.getElementById('documents').dataset.loaded === 'true'"
"""The index panel has listed the documents (after opening it, or after a change)."""
MARKUP_QUESTION = "Who runs the Zorblat quartz mine of Vexhollow?"


@pytest.fixture(scope="module")
def example_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example index, built once; each server gets a copy (an open cache is one process's)."""
    return build_index(tmp_path_factory.mktemp("service_page") / "index", default_model_path(),
                       example_corpus_path() / "documents", chunk_tokens=256)


@pytest.fixture(scope="module")
def served(example_index: Path, tmp_path_factory: pytest.TempPathFactory):
    index = shutil.copytree(example_index, tmp_path_factory.mktemp("served") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running, \
            httpx.Client(base_url=running.url, timeout=120) as client, Browser(width=1000, height=800) as browser:
        browser.open(running.url + "/")
        yield running, client, browser


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("service_page_screenshots")
    print(f"\nscreenshots of the page: {directory}")
    return directory


def asked(client: httpx.Client, question: str, mode: str = "hypic") -> dict:
    response = client.post("/v1/ask", json={"question": question, "mode": mode, **ASK})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_and_its_assets_are_served_apart_from_the_api(served) -> None:
    _, client, _ = served
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/ui/page.js").status_code == 200 and client.get("/ui/page.css").status_code == 200
    assert client.get("/ui/missing.js").json()["error"]["code"] == "not_found"
    assert client.get("/docs").status_code == 200
    assert "/" not in client.get("/openapi.json").json()["paths"]


def test_an_answer_asked_by_keyboard_streams_and_equals_v1_ask(served, artefacts: Path) -> None:
    _, client, browser = served
    ask_on_page(browser, PICTURE_QUESTION)
    shown = shown_answer(browser)
    expected = asked(client, PICTURE_QUESTION)
    assert shown["done"] == "true" and shown["text"] == expected["answer"] and expected["answer"]
    assert [source["heading"] for source in shown["sources"]] == \
        [f"{source['rank']}. {source['doc_id']}" for source in expected["sources"]]
    assert [source["chunk"] for source in shown["sources"]] == [source["text"] for source in expected["sources"]]
    usage = expected["usage"]
    assert shown["numbers"]["Prompt tokens"] == str(usage["prompt_tokens"])
    assert shown["numbers"]["Read from the cache"].startswith(f"{usage['cached_tokens']} (")
    assert shown["numbers"]["Recomputed"].startswith(f"{usage['recomputed_tokens']} (")
    assert usage["cached_tokens"] > 0
    assert "Time to first token" in shown["numbers"]
    parts = expected["prompt_parts"]
    assert [part["part"] for part in shown["parts"]] == [part["part"] for part in parts]
    seams = [line["line"] for line in shown["parts"] if line["part"] == "chunk"]
    assert all("recomputed (seam)" in line for line in seams), seams
    assert browser.exceptions == []
    print(browser.screenshot(artefacts / "answer-light-1000.png"))


def test_side_by_side_answers_with_full_and_hypic(served) -> None:
    _, client, browser = served
    ask_on_page(browser, PICTURE_QUESTION, compare=True)
    assert shown_answer(browser, "full")["text"] == asked(client, PICTURE_QUESTION, "full")["answer"]
    full_parts = shown_answer(browser, "full")["parts"]
    assert all(part["line"].endswith("recomputed whole") for part in full_parts if part["part"] == "chunk")
    assert "Read from the cache" in shown_answer(browser, "hypic")["numbers"]
    browser.evaluate("document.getElementById('compare').checked = false")


def test_a_document_of_markup_added_on_the_page_shows_as_text_and_never_runs(served, artefacts: Path) -> None:
    _, client, browser = served
    browser.evaluate("document.getElementById('tab-index').click()")
    browser.wait_for(INDEX_LOADED)
    browser.evaluate(f"document.getElementById('doc-id').value = {json.dumps(MARKUP_ID)}; "
                     f"document.getElementById('doc-text').value = {json.dumps(MARKUP_TEXT)}")
    browser.evaluate("document.getElementById('doc-text').focus()")  # past the 54 documents' Remove buttons
    browser.press("Tab")
    assert browser.evaluate("document.activeElement.textContent") == "Add this document"
    browser.press("Enter")
    browser.wait_for("document.getElementById('job-status').textContent.startsWith('succeeded')", 120)
    row = browser.wait_for(f"[...document.querySelectorAll('#documents tbody tr')]"
                           f".find((row) => row.dataset.docId === {json.dumps(MARKUP_ID)})?.cells[0].firstChild.textContent")
    assert row == MARKUP_ID
    browser.evaluate("document.getElementById('tab-ask').click()")
    ask_on_page(browser, MARKUP_QUESTION)
    shown = shown_answer(browser)
    mine = [source for source in shown["sources"] if source["heading"].endswith(MARKUP_ID)]
    assert mine and mine[0]["chunk"].startswith("<script>window.__pwned=1</script><img src=x"), shown["sources"]
    assert asked(client, MARKUP_QUESTION)["answer"] == shown["text"]
    assert browser.evaluate("typeof window.__pwned") == "undefined"
    assert browser.evaluate("document.querySelectorAll('main script, main img, main b').length") == 0
    browser.evaluate("document.querySelectorAll('#answers details').forEach((node) => { node.open = true; })")
    assert browser.evaluate("typeof window.__pwned") == "undefined"
    print(browser.screenshot(artefacts / "markup-document-light-1000.png"))
    # removed again from the page, by keyboard: a first press arms the button, the second removes
    before = client.get("/v1/documents", params={"limit": 1}).json()["total"]
    browser.evaluate("document.getElementById('tab-index').click()")
    browser.wait_for(INDEX_LOADED)
    button = ("[...document.querySelectorAll('#documents tbody tr')].find((row) => row.dataset.docId === "
              f"{json.dumps(MARKUP_ID)})?.querySelector('button')")
    browser.wait_for(f"!!{button}")
    browser.evaluate(f"{button}.focus()")
    browser.press("Enter")
    assert browser.evaluate(f"{button}.textContent") == "Press again to remove"
    browser.press("Enter")
    browser.wait_for("document.getElementById('job-status').textContent.startsWith('Removed')")
    assert client.get("/v1/documents", params={"limit": 1}).json()["total"] == before - 1
    browser.wait_for(f"!{button}")
    browser.evaluate("document.getElementById('tab-ask').click()")


def test_the_page_fits_320_px_light_and_dark(served, artefacts: Path) -> None:
    _, _, browser = served
    for dark in (False, True):
        path = browser.screenshot(artefacts / f"answer-{'dark' if dark else 'light'}-320.png", width=320, dark=dark)
        print(path)
        assert path.stat().st_size > 0
    browser.viewport(320, 800, dark=True)
    assert browser.evaluate("document.documentElement.scrollWidth") <= 320
    background = browser.evaluate("getComputedStyle(document.body).backgroundColor")
    browser.viewport(1000, 800)
    assert background != browser.evaluate("getComputedStyle(document.body).backgroundColor")  # dark is dark


@pytest.mark.skipif("api_key" not in ServerConfig.__dataclass_fields__,
                    reason="this server has no API keys yet (ServerConfig.api_key)")
def test_a_server_that_wants_a_key_gets_it_from_the_key_field(served, example_index: Path, tmp_path: Path) -> None:
    """With `serve --api-key`, the page's first call is refused with 401: the key field appears, the key typed
    there (kept in sessionStorage) is sent as a Bearer token and the question is answered."""
    running, client, browser = served
    key = "page-test-key"
    index = shutil.copytree(example_index, tmp_path / "index")
    config = ServerConfig(index_dir=index, device="cpu", api_key=key)
    with ServerThread(config) as keyed:
        browser.open(keyed.url + "/")
        browser.evaluate("sessionStorage.clear()")
        browser.evaluate(f"document.getElementById('question').value = {json.dumps(PICTURE_QUESTION)}; "
                         "document.getElementById('ask-form').requestSubmit()")
        browser.wait_for("!document.getElementById('key-panel').hidden")
        assert browser.evaluate("document.activeElement.id") == "key-input"
        browser.type(key)
        browser.press("Enter")
        browser.wait_for(f"{card('hypic')}?.dataset.done")
        assert shown_answer(browser)["text"] == asked(client, PICTURE_QUESTION)["answer"]
        assert browser.evaluate("sessionStorage.getItem('hypic-rag-api-key')") == key
        browser.evaluate("sessionStorage.clear()")
    browser.open(running.url + "/")


def test_no_ui_leaves_the_page_out(tmp_path: Path) -> None:
    """`serve --no-ui` (`ServerConfig(page=False)`): `/` and `/ui/` are 404s like any unknown path (the app is
    asked in process, without starting its model: the page needs none)."""
    from fastapi.testclient import TestClient

    from hypic_rag.server import create_app

    def statuses(page: bool) -> list[int]:
        client = TestClient(create_app(ServerConfig(index_dir=tmp_path, page=page)))
        return [client.get(path).status_code for path in ("/", "/ui/page.js")]

    assert statuses(True) == [200, 200]
    assert statuses(False) == [404, 404]
