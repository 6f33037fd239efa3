"""The routing policy on its own: target and exclude, prompt-prefix affinity and when it yields, load,
context fit; the prefix key of each API's body; the token estimate; the affinity LRU."""

from __future__ import annotations

from mesh_llm.mesh.proxy import Answer, verdict
from mesh_llm.mesh.routing import Affinity, Candidate, estimate_tokens, order, prefix_key


def node(node_id: str, active=0, waiting=0, max_batch=1, context=8192, reachable=True, free_kv=None,
         demoted=False):
    return Candidate(node_id, False, context, active, waiting, max_batch, free_kv, reachable, demoted)


def ids(ranked) -> list[str]:
    return [c.id for c in ranked]


def test_least_loaded_first():
    ranked = order([node("a", active=1, waiting=2), node("b", active=1), node("c")], need_tokens=10)
    assert ids(ranked) == ["c", "b", "a"]


def test_spare_batch_room_beats_a_saturated_node():
    # 3 of 8 slots busy vs 1 of 1 busy with one waiting: the batching node takes the next request
    ranked = order([node("full", active=1, waiting=1), node("batching", active=3, max_batch=8)], need_tokens=10)
    assert ids(ranked) == ["batching", "full"]


def test_a_node_without_free_kv_for_the_prompt_counts_as_saturated():
    ranked = order([node("kv-full", free_kv=100), node("busy", active=1, max_batch=4)], need_tokens=500)
    assert ids(ranked) == ["busy", "kv-full"]


def test_context_that_fits_comes_first_but_the_rest_stay_as_fallback():
    ranked = order([node("small", context=2048), node("big", active=1, context=32768)], need_tokens=4000)
    assert ids(ranked) == ["big", "small"]


def test_a_demoted_node_goes_after_busier_ones_and_loses_its_affinity_but_stays_a_fallback():
    ranked = order([node("liar", demoted=True), node("busy", active=1, waiting=3), node("small", context=10)],
                   need_tokens=100, prefix="p", affinity="liar")
    assert ids(ranked) == ["busy", "liar", "small"]  # a context that does not fit still goes last
    assert ids(order([node("liar", demoted=True), node("busy", active=1)], need_tokens=10, target="liar"))[0] == "liar"


def test_which_failures_demote_a_node():
    from mesh_llm.mesh.proxy import Failure

    def said(status: int) -> Failure:
        return Failure("x", Answer(status, [], b"{}"))

    assert Failure("sent nothing in 10s").at_fault and said(500).at_fault and said(404).at_fault
    assert not said(429).at_fault and not said(400).at_fault  # full, or a prompt over its context


def test_unreachable_nodes_go_last():
    ranked = order([node("quiet", reachable=False), node("busy", active=1, waiting=3)], need_tokens=10)
    assert ids(ranked) == ["busy", "quiet"]


def test_affinity_keeps_the_cache_warm_node_when_it_is_a_little_busier():
    pool = [node("warm", active=1), node("idle")]
    assert ids(order(pool, need_tokens=10, prefix="p", affinity="warm"))[0] == "warm"


def test_affinity_yields_when_the_warm_node_is_much_busier():
    pool = [node("warm", active=1, waiting=2), node("idle")]
    assert ids(order(pool, need_tokens=10, prefix="p", affinity="warm")) == ["idle", "warm"]


def test_affinity_yields_when_the_prompt_outgrew_its_context():
    pool = [node("warm", context=1024), node("other")]
    assert ids(order(pool, need_tokens=2000, prefix="p", affinity="warm"))[0] == "other"


def test_target_overrides_affinity_and_load_and_exclude_removes():
    pool = [node("warm"), node("busy", active=1, waiting=5), node("gone")]
    ranked = order(pool, need_tokens=10, prefix="p", affinity="warm", target="busy", exclude=frozenset({"gone"}))
    assert ids(ranked) == ["busy", "warm"]
    assert ids(order(pool, need_tokens=10, target="nobody"))[-1] == "busy"  # a target that is not there


def test_ties_follow_the_prefix_so_entry_nodes_agree():
    pool = [node(f"n{i}") for i in range(8)]
    picks = {order(pool, need_tokens=10, prefix="conversation-1")[0].id for _ in range(5)}
    assert len(picks) == 1
    spread = {order(pool, need_tokens=10, prefix=f"conversation-{i}")[0].id for i in range(40)}
    assert len(spread) > 3  # different conversations spread over the nodes


def test_a_new_prefix_goes_home_whatever_small_load_differences_say():
    """Two entry nodes that hold different load figures for the seconds after a turn still pick
    the same node for a conversation neither has routed; a home much busier than another yields."""
    homes = {}
    for i in range(40):
        prefix = f"conversation-{i}"
        seen_by_one = order([node("a", active=1, max_batch=4), node("b", max_batch=4)], need_tokens=10, prefix=prefix)
        seen_by_other = order([node("a", max_batch=4), node("b", active=2, max_batch=4)], need_tokens=10, prefix=prefix)
        assert seen_by_one[0].id == seen_by_other[0].id
        homes[prefix] = seen_by_one[0].id
    assert set(homes.values()) == {"a", "b"}  # conversations still spread
    prefix = next(p for p, home in homes.items() if home == "a")
    crowded = order([node("a", active=4, waiting=4, max_batch=4), node("b", max_batch=4)], need_tokens=10,
                    prefix=prefix)
    assert ids(crowded) == ["b", "a"]


def test_prefix_key_of_a_chat_is_its_start_up_to_the_first_user_message():
    system = {"role": "system", "content": "Be brief."}
    turn1 = {"model": "m", "messages": [system, {"role": "user", "content": "Hi"}]}
    turn3 = {"model": "m", "messages": [system, {"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "Hello"},
                                         {"role": "user", "content": "More"}], "max_tokens": 5}
    assert prefix_key("m", turn1) == prefix_key("m", turn3)
    other_user = {"model": "m", "messages": [system, {"role": "user", "content": "Bye"}]}
    assert prefix_key("m", other_user) != prefix_key("m", turn1)
    with_tools = {**turn1, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert prefix_key("m", with_tools) != prefix_key("m", turn1)
    assert prefix_key("other-model", turn1) != prefix_key("m", turn1)


def test_prefix_key_of_responses_and_completions_bodies():
    first = {"input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief."}
    later = {"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                       {"role": "user", "content": "More"}], "instructions": "Be brief."}
    assert prefix_key("m", first) == prefix_key("m", later)
    long_doc = "x" * 1000
    assert prefix_key("m", {"prompt": long_doc + "Q1"}) == prefix_key("m", {"prompt": long_doc + "Q2"})
    assert prefix_key("m", {"prompt": list(range(100))}) == prefix_key("m", {"prompt": list(range(70))})
    assert prefix_key("m", {"foo": 1}) is None


def test_estimate_counts_the_prompt_and_the_answer_asked_for():
    short = estimate_tokens({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100})
    long = estimate_tokens({"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 100})
    assert 100 < short < 150 and 4000 < long < 6000
    assert estimate_tokens({"prompt": [1] * 300, "max_tokens": 16}) == 316


def test_affinity_lru_is_bounded():
    table = Affinity(max_entries=3)
    for i in range(5):
        table.record(f"p{i}", f"n{i}")
    assert len(table) == 3 and table.get("p0") is None and table.get("p4") == "n4"
    table.get("p2")  # recently used: kept
    table.record("p5", "n5")
    assert table.get("p2") == "n2" and table.get("p3") is None


def test_which_answers_send_the_request_to_the_next_node():
    def answer(status, code=None):
        return Answer(status, [], b'{"error": {"code": %s}}' % (f'"{code}"' if code else "null").encode())

    assert verdict(answer(200)) is None
    assert verdict(answer(400, "invalid_value")) is None  # the client's mistake: any node says the same
    assert verdict(answer(401)) is None
    assert verdict(answer(400, "context_length_exceeded")) is not None
    for status in (404, 429, 500, 503):
        assert verdict(answer(status)) is not None
