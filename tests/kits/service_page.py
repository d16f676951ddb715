"""Driving the service's page (`hypic_rag/server/static/`) in a headless browser, and the picture in the docs.

    PYTHONPATH=tests python -m kits.service_page docs/service-page.png

builds the bundled example index in a temporary directory, serves it, asks one question on the page with the
side-by-side comparison on, and saves the page as a small PNG (what `docs/service.md` shows). The browser test
(`tests/server/test_service_page.py`) asks through the same functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from kits.browser import Browser, BrowserError, chromium_missing

logger = logging.getLogger(__name__)

PICTURE_QUESTION = "What is the hobby of Gramux Mastem?"
PICTURE_WIDTH = 860
PICTURE_COLOURS = 32


def card(mode: str) -> str:
    """A script expression for the page's answer card of `mode`."""
    return f"document.querySelector('#answer-{mode}')"


def ask_on_page(browser: Browser, question: str, *, compare: bool = False, timeout_s: float = 120.0) -> None:
    """Ask `question` with the keyboard only: Tab to the question box, type, Enter; waits until every answer card
    is complete. compare: tick the side-by-side box first (the same way, by keyboard)."""
    browser.evaluate("document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0)")
    if browser.evaluate("document.getElementById('compare').checked") != compare:
        browser.evaluate("document.querySelector('#ask-form details').open = true")
        focus_by_tab(browser, "compare")
        browser.press(" ")
    focus_by_tab(browser, "question")
    browser.evaluate("document.getElementById('question').select()")
    browser.type(question)
    browser.press("Enter")
    modes = ("hypic", "full") if compare else ("hypic",)
    ready = " && ".join(f"{card(mode)}?.dataset.done" for mode in modes)
    browser.wait_for(f"!document.getElementById('ask-button').disabled && ({ready})", timeout_s)


def focus_by_tab(browser: Browser, element_id: str, most: int = 30) -> None:
    """Press Tab until the element `element_id` has the focus (from the start of the page)."""
    browser.evaluate("document.activeElement && document.activeElement.blur()")
    for _ in range(most):
        browser.press("Tab")
        if browser.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
    raise AssertionError(f"{most} presses of Tab never reached #{element_id}")


def shown_answer(browser: Browser, mode: str = "hypic") -> dict[str, Any]:
    """What the page shows for the answer of `mode`: its text, the sources' document names and chunk texts, the
    numbers (term -> value) and the prompt's parts (their kinds and lines)."""
    return browser.evaluate(f"""(() => {{
        const root = {card(mode)};
        const terms = [...root.querySelectorAll('.numbers dt')].map((node) => node.textContent);
        const values = [...root.querySelectorAll('.numbers dd')].map((node) => node.textContent);
        return {{
            text: root.querySelector('.answer-text').textContent,
            done: root.dataset.done,
            sources: [...root.querySelectorAll('.sources > li')].map((item) => ({{
                heading: item.querySelector('strong').textContent,
                chunk: item.querySelector('pre.chunk').textContent,
                chunk_id: item.dataset.chunkId,
            }})),
            numbers: Object.fromEntries(terms.map((term, i) => [term, values[i]])),
            parts: [...root.querySelectorAll('.prompt > li')].map((item) => ({{
                part: item.dataset.part, line: item.querySelector('div').textContent,
            }})),
        }};
    }})()""")


def picture(path: Path, *, width: int = PICTURE_WIDTH, dark: bool = False) -> Path:
    """Serve the bundled example index, ask `PICTURE_QUESTION` on the page side by side, save the page at
    `path` (a palette PNG)."""
    from hypic_rag.demo.default_model import default_model_path, example_corpus_path
    from hypic_rag.server import ServerConfig
    from hypic_rag.server.runner import ServerThread
    from kits.corpora import build_index

    with tempfile.TemporaryDirectory(prefix="hypic-page-") as scratch:
        index = build_index(Path(scratch) / "index", default_model_path(), example_corpus_path() / "documents",
                            chunk_tokens=256)
        with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running, \
                Browser(width=width, height=700) as browser:
            browser.open(running.url + "/")
            ask_on_page(browser, PICTURE_QUESTION, compare=True)
            browser.evaluate("document.querySelector('#ask-form details').open = false; "
                             f"{card('hypic')}.querySelector('.sources details').open = true")
            return browser.screenshot(path, width=width, dark=dark, colours=PICTURE_COLOURS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kits.service_page", description=__doc__.split("\n")[0])
    parser.add_argument("output", type=Path, help="the PNG to write (docs/service-page.png)")
    parser.add_argument("--width", type=int, default=PICTURE_WIDTH, help="CSS pixels wide (900)")
    parser.add_argument("--dark", action="store_true", help="the dark colour scheme")
    args = parser.parse_args(argv)
    missing = chromium_missing()
    if missing is not None:
        print(f"service_page: error: {missing}", file=sys.stderr)
        return 2
    try:
        path = picture(args.output, width=args.width, dark=args.dark)
    except BrowserError as error:
        print(f"service_page: error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
