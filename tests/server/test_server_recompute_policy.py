"""The service's recompute policy: set in its config (checked there), named per request in /v1/ask (a bad one is
400), reported in the answer; a real uvicorn server on 127.0.0.1 over a copy of the tiny index."""

from __future__ import annotations

import httpx
import pytest

from hypic_rag.runtime.recompute_policy import RecomputePolicyError
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread

QUESTION = "Where does the river flow?"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index):
    index = copy_tiny_index(tmp_path_factory.mktemp("server_policy") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", recompute_policy="whole:1")) as running:
        with httpx.Client(base_url=running.url, timeout=120) as http:
            yield http


def ask(client: httpx.Client, **options) -> httpx.Response:
    return client.post("/v1/ask", json={"question": QUESTION, "max_new_tokens": 3, "top_k": 3, **options})


@pytest.mark.parametrize("value", ["bogus", "whole:0", "budget:0.5", ""])
def test_the_config_refuses_a_bad_policy(tmp_path, value: str) -> None:
    with pytest.raises(RecomputePolicyError) as raised:
        ServerConfig(index_dir=tmp_path, recompute_policy=value)
    assert isinstance(raised.value, ValueError) and "\n" not in str(raised.value)


def test_answers_use_the_configured_policy_unless_the_request_names_one(client: httpx.Client) -> None:
    configured = ask(client)
    assert configured.status_code == 200, configured.text
    assert configured.json()["recompute_policy"] == "whole:1@8"
    seam = ask(client, recompute_policy="seam")
    assert seam.status_code == 200, seam.text
    assert seam.json()["recompute_policy"] == "seam@8"
    everything = ask(client, recompute_policy="budget:1000")
    assert everything.json()["recompute_policy"] == "budget:1000@8"
    tokens = [response.json()["usage"]["recomputed_tokens"] for response in (seam, configured, everything)]
    assert tokens[0] < tokens[1] < tokens[2]
    assert ask(client, mode="full").json()["recompute_policy"] == ""


@pytest.mark.parametrize("value", ["bogus", "whole:0", "seam:3", "budget:"])
def test_a_bad_policy_in_a_request_is_400_naming_the_field(client: httpx.Client, value: str) -> None:
    response = ask(client, recompute_policy=value)
    assert response.status_code == 400, response.text
    assert "recompute policy" in response.text or "recompute_policy" in response.text


def test_a_policy_of_the_wrong_type_is_400(client: httpx.Client) -> None:
    assert ask(client, recompute_policy=3).status_code == 400


def test_prompt_parts_show_which_tokens_each_chunk_recomputed(client: httpx.Client) -> None:
    """`prompt_parts`: under whole:1 the best-ranked chunk is recomputed whole and the others their seam of 8; under
    `full` every token is recomputed; the question always; the parts add up to the usage."""
    for options in ({}, {"recompute_policy": "seam"}, {"mode": "full"}, {"mode": "prefix"}, {"mode": "prefix"},
                    {"mode": "transition"}):
        answer = ask(client, **options).json()
        parts = answer["prompt_parts"]
        chunks = [part for part in parts if part["part"] == "chunk"]
        assert len(chunks) == 3 and parts[-1]["part"] == "question"
        assert parts[-1]["recomputed_tokens"] == parts[-1]["tokens"]
        for name in ("recomputed_tokens", "cached_tokens", "encoded_tokens"):
            assert sum(part[name] for part in parts) == answer["usage"][name], (options, name)
        recomputed = [part["recomputed_tokens"] for part in chunks]
        whole = [part["recomputed_tokens"] == part["tokens"] for part in chunks]
        if options.get("mode") == "full":
            assert all(whole) and all(part["recomputed_tokens"] == part["tokens"] for part in parts)
        elif options.get("mode") == "prefix":  # a segment either from a prefix checkpoint or recomputed whole
            assert all(part["recomputed_tokens"] in (0, part["tokens"]) for part in parts)
        elif options.get("mode") == "transition":  # seam-0 entries: nothing of a chunk recomputed
            assert recomputed == [0, 0, 0]
        elif options:
            assert recomputed == [min(8, part["tokens"]) for part in chunks]
        else:  # the first chunk of the prompt is the best direct hit: rank 0
            assert whole[0] and recomputed[1:] == [min(8, part["tokens"]) for part in chunks[1:]]


def test_a_served_index_answers_under_its_calibrated_policy(tmp_path, copy_tiny_index) -> None:
    """No policy in the service's config: answers use the one calibration recorded in the index's manifest, and the
    cache statistics say where it came from; a request may still name another."""
    from hypic_rag.retrieval.corpus_index import record_recompute_policy

    index = copy_tiny_index(tmp_path / "index")
    record_recompute_policy(index, {"policy": "budget:2+chained", "kl_target": 0.1, "met": True})
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        with httpx.Client(base_url=running.url, timeout=120) as http:
            calibrated = ask(http)
            assert calibrated.status_code == 200, calibrated.text
            assert calibrated.json()["recompute_policy"] == "budget:2@8+chained"
            answering = http.get("/v1/cache/stats").json()["answering"]
            assert answering["recompute_policy"] == "budget:2@8+chained" and answering["policy_from"] == "calibration"
            assert ask(http, recompute_policy="seam").json()["recompute_policy"] == "seam@8"
