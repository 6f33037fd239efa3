"""Two nodes serve the same model and a third (a client node) takes the requests: a conversation stays
on the node whose prompt cache holds it, turn after turn; ``x-mesh-target`` and ``x-mesh-exclude``
override that; a prompt over one node's context goes to the other; a client that leaves a proxied
stream frees the serving node's worker."""

from __future__ import annotations

import re

import httpx
import pytest
from mesh_nodes import chat, served_models, wait_for

pytestmark = pytest.mark.slow  # real servers or real models: `make check` leaves it out

REPLICAS = ("replica-1", "replica-2")


@pytest.fixture(scope="module")
def mesh(nodes):
    one = nodes.start("replica-1", "--alias", "smol")
    two = nodes.start("replica-2", "--alias", "smol", "--join", one.url, "--ctx-size", "512")
    entry = nodes.start("entry", "--client", "--join", two.url, model=False)
    wait_for(lambda: sorted(served_models(entry).get("smol", [])) == list(REPLICAS), 15,
             "the entry sees both replicas")
    return {"replica-1": one, "replica-2": two, "entry": entry}


def test_a_conversation_stays_on_the_node_with_its_cache_and_target_overrides_it(mesh):
    entry = mesh["entry"]
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one sentence."},
                {"role": "user", "content": "Name a large animal."}]
    served_by, cached = [], []
    for turn in range(5):
        reply = chat(entry, "smol", messages=messages, max_tokens=12)
        assert reply.status_code == 200, reply.text
        served_by.append(reply.headers["x-mesh-served-by"])
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [{"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Now name another one, number {turn + 2}."}]
    assert len(set(served_by)) == 1 and served_by[0] in REPLICAS, served_by
    assert cached[0] == 0 and all(later > earlier for earlier, later in zip(cached, cached[1:])), cached

    home = served_by[0]
    other = next(r for r in REPLICAS if r != home)
    moved = chat(entry, "smol", messages=messages, max_tokens=4, headers={"x-mesh-target": other})
    assert moved.status_code == 200 and moved.headers["x-mesh-served-by"] == other
    assert moved.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # other never saw it
    away = chat(entry, "smol", messages=messages, max_tokens=4, headers={"x-mesh-exclude": other})
    assert away.headers["x-mesh-served-by"] == home


def test_a_prompt_over_one_node_s_context_is_served_by_the_other(mesh):
    entry = mesh["entry"]
    long_prompt = "Here is a list of words to remember: " + " ".join(f"word{i}" for i in range(200))
    reply = chat(entry, "smol", long_prompt, headers={"x-mesh-target": "replica-2"}, max_tokens=2)
    assert reply.status_code == 200 and reply.headers["x-mesh-served-by"] == "replica-1"
    assert reply.headers["x-mesh-failed"] == "replica-2: the prompt does not fit its context"
    assert reply.json()["usage"]["prompt_tokens"] > 512
    too_long = chat(entry, "smol", long_prompt * 4, max_tokens=2)  # over every node's context
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_a_client_that_leaves_a_proxied_stream_frees_the_serving_worker(mesh):
    entry = mesh["entry"]
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", entry.url + "/v1/completions", json=body, timeout=120) as response:
        serving = mesh[response.headers["x-mesh-served-by"]]
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data: {")
            if received >= 5:
                break  # leave mid-stream
    wait_for(lambda: "finish=cancelled" in serving.output(), 30, "the serving node cancels the generation")
    match = re.search(r"completion=(\d+) .*finish=cancelled", serving.output())
    assert int(match.group(1)) < 1000
    assert chat(entry, "smol", max_tokens=2).status_code == 200
