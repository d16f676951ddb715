#!/usr/bin/env python
"""Serve the bundled example corpus over HTTP and ask it questions, offline, on the bundled default model.

    python examples/serve_and_ask.py                       # builds an index in a temporary directory
    python examples/serve_and_ask.py --workdir /tmp/hypic  # keeps (and reuses) the index there

Steps: precompute an index of `hypic_rag/demo/assets/example_corpus/documents` (chunk, embed, encode every chunk into
the segment cache), start the REST service on 127.0.0.1 with an API key (as `hypic-rag serve --index DIR --api-key
KEY` would), then with httpx, every request sending `Authorization: Bearer KEY`: ask two questions (one streamed),
add a document, wait for its job, ask about it, delete it, and print the cache statistics. `--model PATH` uses
another checkpoint.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time
from pathlib import Path

import httpx

from hypic_rag import ServerConfig, ServerThread, build_index, default_model_path, example_corpus_path, read_questions

NEW_DOCUMENT = {
    "id": "added/fenwick-observatory.md",
    "text": "The Fenwick Observatory stands on Marrow Hill. Its director is Oska Lindqvist, who founded it in 1962.",
}


def print_answer(answer: dict) -> None:
    print(f"  answer: {answer['answer']!r}  ({answer['finish_reason']})")
    for source in answer["sources"][:3]:
        print(f"    source {source['doc_id']} #{source['position']} score {source['score']:.3f}")
    usage, timings = answer["usage"], answer["timings"]
    print(f"  tokens: {usage['prompt_tokens']} prompt, {usage['cached_tokens']} from cache, "
          f"{usage['encoded_tokens']} newly encoded, {usage['recomputed_tokens']} recomputed; "
          f"segments {usage['cache_hits']} hit / {usage['cache_misses']} encoded")
    print(f"  time to first token {timings['time_to_first_token_ms']:.0f} ms (retrieval {timings['retrieval_ms']:.0f}, "
          f"cache load {timings['cache_load_ms']:.0f}, compose {timings['compose_ms']:.0f}, prefill "
          f"{timings['prefill_ms']:.0f}), total {timings['total_ms']:.0f} ms")


def ask_streamed(client: httpx.Client, question: str) -> None:
    print(f"Q (streamed): {question}")
    print("  tokens: ", end="", flush=True)
    with client.stream("POST", "/v1/ask", json={"question": question, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "token":
                print(event["text"], end="", flush=True)
            elif event["type"] == "done":
                print()
                print_answer({**event, "sources": []})
            elif event["type"] == "error":
                print(f"\n  error: {event['error']['message']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where the index is kept (default: a temporary directory)")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bundled default model)")
    args = parser.parse_args()
    model = args.model or default_model_path()
    if not (model / "config.json").is_file():
        parser.error(f"no model at {model}; install the bundled default model or pass --model PATH")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hypic-serve-"))
    index = workdir / "index"
    print(f"precomputing {example_corpus_path() / 'documents'} into {index} ...")
    build_index(example_corpus_path() / "documents", index, model=model, chunk_tokens=256)

    questions = read_questions(example_corpus_path() / "questions.jsonl")
    api_key = secrets.token_urlsafe(24)  # a real server: `hypic-rag serve --index DIR` with HYPIC_RAG_API_KEY set
    server = ServerThread(ServerConfig(index_dir=index, api_key=api_key))
    headers = {"Authorization": f"Bearer {api_key}"}
    with server, httpx.Client(base_url=server.url, headers=headers, timeout=300) as client:
        print(f"serving on {server.url} (OpenAPI page: {server.url}/docs)")
        print(f"health: {client.get('/healthz').json()}")
        print(f"without the key: {httpx.post(f'{server.url}/v1/ask', json={'question': 'Hi?'}).status_code}")
        question = questions[0]
        print(f"Q: {question.text}   (expected: {question.answer})")
        response = client.post("/v1/ask", json={"question": question.text, "top_k": 8})
        response.raise_for_status()
        print_answer(response.json())
        ask_streamed(client, questions[1].text)

        accepted = client.post("/v1/documents", json={"documents": [NEW_DOCUMENT]}).json()
        print(f"added a document: job {accepted['job_id']}")
        for _ in range(600):
            job = client.get(accepted["status_url"]).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.1)
        print(f"  job {job['status']}: {job['progress']}")
        response = client.post("/v1/ask", json={"question": "Who is the director of the Fenwick Observatory?"})
        print_answer(response.json())
        deleted = client.delete(f"/v1/documents/{NEW_DOCUMENT['id']}").json()
        print(f"deleted: {deleted}")
        stats = client.get("/v1/cache/stats").json()
        print(f"cache: {stats['cache']['entries']} entries, {stats['cache']['value_bytes']} bytes; this server: "
              f"{stats['server']['cache_hits']} hits, {stats['server']['cache_misses']} misses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
