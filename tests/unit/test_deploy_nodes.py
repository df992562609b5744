"""deploy.nodes: which Ray nodes are alive, and why a worker actor that Ray has not placed waits."""

from __future__ import annotations

import pytest

from deploy.nodes import NodeView, demand, labels_match, node_view, placement_wait

A, B = "a" * 56, "b" * 56


def test_only_alive_nodes_with_an_id_count_and_keep_their_totals() -> None:
    view = node_view(
        [
            {
                "NodeID": A,
                "Alive": True,
                "Resources": {"CPU": 2.0, "prefill_slot": 1.0},
                "Labels": {"pool": "p"},
            },
            {"NodeID": B, "Alive": False, "Resources": {"CPU": 1.0, "decode_slot": 1.0}},
            {"NodeID": "", "Alive": True, "Resources": {"CPU": 8.0}},
        ]
    )
    assert view.alive == frozenset({A})
    assert view.totals[A] == {"CPU": 2.0, "prefill_slot": 1.0}
    assert view.labels == {A: {"pool": "p"}}


@pytest.mark.parametrize(
    ("num_gpus", "resources", "wanted"),
    [
        (0, {}, {}),  # a CPU worker asks for nothing (num_cpus 0)
        (0, {"decode_slot": 1}, {"decode_slot": 1.0}),
        (1, {}, {"GPU": 1.0, "CPU": 1.0}),
        (0.5, {"node_b": 2}, {"GPU": 0.5, "CPU": 1.0, "node_b": 2.0}),
    ],
)
def test_demand_is_what_one_node_must_offer(num_gpus: float, resources: dict, wanted: dict) -> None:
    assert demand(num_gpus, resources) == wanted


def test_a_worker_of_several_gpus_needs_each_rank_s_bundle_on_one_node() -> None:
    """Each GPU rank's placement-group bundle holds the CPU its actor asks Ray for (Ray refuses an actor whose
    request fits no bundle: seen on 4x H200 with bundles of GPUs only), and the node must offer them all."""
    from deploy.ranks import bundles

    ranks = bundles(2, 1, {"tandem_prefill": 1})
    assert ranks == [{"tandem_prefill": 1, "GPU": 1.0, "CPU": 1.0}] * 2
    total = {name: sum(b.get(name, 0) for b in ranks) for name in ("GPU", "CPU", "tandem_prefill")}
    assert demand(1, {"tandem_prefill": 1}, ranks=2) == total
    assert bundles(2, 0, {})[0] == {"CPU": 0.01}  # CPU ranks: a sliver each (their actors ask num_cpus 0)


def test_a_resource_no_alive_node_has_names_it_and_says_a_node_must_join() -> None:
    view = NodeView({A: {"CPU": 2.0, "prefill_slot": 1.0}})
    reason = placement_wait({"decode_slot": 1.0}, view, {"CPU": 2.0, "prefill_slot": 1.0})
    assert reason == "no alive node has {decode_slot: 1}; it starts once such a node joins"


def test_resources_split_over_two_nodes_do_not_place_one_actor() -> None:
    view = NodeView({A: {"GPU": 1.0, "CPU": 4.0}, B: {"decode_slot": 1.0, "CPU": 4.0}})
    reason = placement_wait({"GPU": 1.0, "decode_slot": 1.0}, view, {"GPU": 1.0, "decode_slot": 1.0})
    assert reason.startswith("no alive node has {GPU: 1, decode_slot: 1}")


def test_a_resource_that_exists_but_is_taken_says_so_naming_only_what_is_short() -> None:
    view = NodeView({A: {"CPU": 4.0, "GPU": 2.0, "decode_slot": 1.0}})
    reason = placement_wait({"GPU": 1.0, "CPU": 1.0, "decode_slot": 1.0}, view, {"CPU": 3.0, "GPU": 1.0})
    assert reason == "every node with {decode_slot: 1} has it in use"


def test_nothing_to_say_when_a_node_could_take_it_now_or_it_asks_for_nothing() -> None:
    view = NodeView({A: {"CPU": 4.0, "decode_slot": 1.0}})
    assert placement_wait({"decode_slot": 1.0}, view, {"CPU": 4.0, "decode_slot": 1.0}) == ""
    assert placement_wait({}, NodeView(), {}) == ""
    assert placement_wait({"decode_slot": 1.0}, NodeView(), {}).startswith("no alive node has")


@pytest.mark.parametrize(
    ("labels", "selector", "match"),
    [
        ({"pool": "decode"}, {"pool": "decode"}, True),
        ({"pool": "prefill"}, {"pool": "decode"}, False),
        ({}, {"pool": "decode"}, False),
        ({"pool": "prefill"}, {"pool": "!decode"}, True),
        ({}, {"pool": "!decode"}, True),  # absent is "not decode"
        ({"pool": "decode"}, {"pool": "!decode"}, False),
        ({"zone": "b"}, {"zone": "in(a, b)"}, True),
        ({"zone": "c"}, {"zone": "in(a,b)"}, False),
        ({"zone": "c"}, {"zone": "!in(a,b)"}, True),
        ({"zone": "a", "pool": "decode"}, {"zone": "in(a,b)", "pool": "decode"}, True),
        ({"zone": "a", "pool": "prefill"}, {"zone": "in(a,b)", "pool": "decode"}, False),
        ({"pool": "x"}, {}, True),
    ],
)
def test_labels_match_as_rays_selector_reads_them(labels: dict, selector: dict, match: bool) -> None:
    assert labels_match(labels, selector) is match


def test_a_label_no_alive_node_has_is_named_before_any_resource() -> None:
    view = NodeView({A: {"CPU": 2.0}, B: {"CPU": 2.0}}, {A: {"pool": "prefill"}, B: {}})
    assert placement_wait({}, view, {"CPU": 4.0}, {"pool": "decode"}) == (
        "no alive node has labels {pool=decode}; it starts once such a node joins"
    )
    assert placement_wait({}, view, {"CPU": 4.0}, {"pool": "prefill"}) == ""
    reason = placement_wait({"GPU": 1.0}, view, {"CPU": 4.0}, {"pool": "prefill"})
    assert reason == "no alive node with labels {pool=prefill} has {GPU: 1}; it starts once such a node joins"


def test_a_pool_takes_ray_labels_and_refuses_a_non_string_selector_naming_it() -> None:
    from deploy.config import parse_config
    from model_runtime.config import ConfigError
    from model_runtime.roles import WorkerRole

    config = parse_config({"decode": {"ray_labels": {"tandem.io/pool": "decode"}}}, "test")
    assert config.pools()[WorkerRole.DECODE].ray_labels == {"tandem.io/pool": "decode"}
    with pytest.raises(
        ConfigError, match=r"^decode\.ray_labels\.tandem\.io/pool: must map a label name to a"
    ):
        parse_config({"decode": {"ray_labels": {"tandem.io/pool": 3}}}, "test")
    with pytest.raises(ConfigError, match=r"^prefill\.ray_labels: must be a mapping"):
        parse_config({"prefill": {"ray_labels": ["decode"]}}, "test")
