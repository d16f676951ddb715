#!/usr/bin/env python
"""An OpenAI-style client gets position-independent reuse from `/v1/completions` without the retriever.

    python examples/openai_client_completions.py                          # starts a server in this process
    python examples/openai_client_completions.py --workdir /tmp/hypic      # ... keeping (and reusing) its index there
    python examples/openai_client_completions.py --url http://127.0.0.1:8000   # or talks to `hypic-rag serve`

A server started with an API key (`serve --api-key KEY`, or HYPIC_RAG_API_KEY) is sent it: `--api-key KEY`, by
default $HYPIC_RAG_API_KEY (the `openai` client's `api_key`, else an `Authorization: Bearer` header).

The client lays out its own prompt as segments separated by `<<PIC_SEP>>`: the instruction, some documents, then
the question (the last segment). Each segment's cache entry is computed once and reused wherever that segment
appears, in any order: the second and third requests below shuffle the documents and still hit the cache. Uses
the `openai` package when installed (`OpenAI(base_url=.../v1)`), else the same wire format through httpx.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from hypic_rag import (
    DEFAULT_PROMPT_FORMAT,
    DEFAULT_SEPARATOR,
    ServerConfig,
    ServerThread,
    build_index,
    default_model_path,
    example_corpus_path,
    read_questions,
)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a server started with `--api-key` checks (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, api_key: str | None) -> str:
    """The id of the model the server serves (`GET /v1/models`): a completion naming another is refused."""
    response = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=60)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def complete(base_url: str, api_key: str | None, model: str, prompt: str) -> dict[str, Any]:
    """One completion through the `openai` client if it is installed, else through httpx."""
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": ["\n"]}
    try:
        from openai import OpenAI
    except ImportError:
        response = httpx.post(f"{base_url}/v1/completions", json=body, headers=auth_headers(api_key), timeout=300)
        response.raise_for_status()
        return response.json()
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "not-needed")  # sent as Authorization: Bearer
    return client.completions.create(**body).model_dump()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running hypic-rag server (default: start one here)")
    parser.add_argument("--workdir", type=Path, help="where the started server's index is kept (default: a temporary "
                        "directory)")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bundled default model)")
    parser.add_argument("--api-key", default=os.environ.get("HYPIC_RAG_API_KEY"),
                        help="the server's API key (default: $HYPIC_RAG_API_KEY; the started server then checks it)")
    args = parser.parse_args()
    documents_dir = example_corpus_path() / "documents"
    question = next(q for q in read_questions(example_corpus_path() / "questions.jsonl") if q.hops == 1)
    gold = (documents_dir / f"{question.gold_doc_ids[0]}.md").read_text(encoding="utf-8").strip()
    others = [p.read_text(encoding="utf-8").strip() for p in sorted(documents_dir.glob("*.md"))[:4]]
    documents = [gold] + [text for text in others if text != gold][:3]

    with ExitStack() as stack:
        base_url = args.url
        if base_url is None:
            model = args.model or default_model_path()
            if not (model / "config.json").is_file():
                parser.error(f"no model at {model}; install the bundled default model or pass --model PATH")
            index = (args.workdir or Path(tempfile.mkdtemp(prefix="hypic-openai-"))) / "index"
            build_index(documents_dir, index, model=model, chunk_tokens=256)
            base_url = stack.enter_context(ServerThread(ServerConfig(index_dir=index, api_key=args.api_key))).url
        model_id = served_model(base_url, args.api_key)
        print(f"server: {base_url}, model {model_id}")
        print(f"question: {question.text}   (expected: {question.answer})")
        shuffler = random.Random(0)
        for attempt in range(3):
            order = list(documents)
            if attempt:
                shuffler.shuffle(order)
            segments = [DEFAULT_PROMPT_FORMAT.prefix] + [DEFAULT_PROMPT_FORMAT.chunk(text) for text in order]
            segments.append(DEFAULT_PROMPT_FORMAT.question(question.text))
            result = complete(base_url, args.api_key, model_id, DEFAULT_SEPARATOR.join(segments))
            usage, timings = result["usage"], (result.get("hypic") or {}).get("timings", {})
            print(f"request {attempt + 1}: {result['choices'][0]['text'].strip()!r}; prompt {usage['prompt_tokens']} "
                  f"tokens, {usage['cached_tokens']} from cache, {usage.get('encoded_tokens')} newly encoded; "
                  f"segments {usage.get('cache_hits')} hit / {usage.get('cache_misses')} encoded; time to first "
                  f"token {timings.get('time_to_first_token_ms', float('nan')):.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
