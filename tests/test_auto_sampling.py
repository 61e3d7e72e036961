"""`--tree auto` when sampling decides from what drafts are kept at that temperature (the heads' recorded
`val_sampled_chain_tau_by_depth`), not from greedy figures: the decision on a fake cost model and fake
acceptance figures, no timing."""

import json
import types

import pytest

from clover_jax.plan import factory
from clover_jax.plan.auto import ChainCost, auto_tree
from clover_jax.trees.static import chain

COST = ChainCost(1.15, 0.14)  # a chain:D step costs 1.15 + 0.14 D plain steps
GREEDY = [1.9, 2.7, 3.3]  # per plain-step cost: 1.48, 1.87, 2.08 tokens -> chain:3
SAMPLED_WEAK = [1.2, 1.25, 1.27]  # 0.93, 0.87, 0.80: nothing pays -> plain
SAMPLED_STRONG = [1.6, 1.9, 2.0]  # 1.24, 1.32, 1.26 -> chain:2


def heads(tmp_path, held_out):
    (tmp_path / "heads.json").write_text(json.dumps({"heads": {"method": "medusa", "num_heads": 3},
                                                     "held_out": held_out}))
    return factory.LoadedDrafter("medusa", types.SimpleNamespace(num_heads=3), tmp_path)


@pytest.fixture
def fake_cost(monkeypatch):
    monkeypatch.setattr(factory, "chain_cost", lambda *a, **k: COST)
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")


@pytest.mark.parametrize("sampled, greedy_pick, sampled_pick", [
    (SAMPLED_WEAK, "chain:3", None),
    (SAMPLED_STRONG, "chain:3", "chain:2"),
    (None, "chain:3", None),  # heads measured before the sampled figure was recorded
])
def test_the_chain_is_picked_by_the_figure_of_the_temperature(tmp_path, fake_cost, sampled, greedy_pick, sampled_pick):
    held_out = {"val_chain_tau_by_depth": GREEDY}
    if sampled is not None:
        held_out["val_sampled_chain_tau_by_depth"] = {"1": sampled}
    drafter = heads(tmp_path, held_out)
    greedy = factory.plan_tree(None, drafter, None, tree="auto", greedy=True, step_cost="auto")
    sampling = factory.plan_tree(None, drafter, None, tree="auto", greedy=False, step_cost="auto")
    assert (greedy.spec, greedy.step_cost) == (greedy_pick, COST.at(int(greedy_pick.split(":")[1])))
    assert greedy.tree == chain(int(greedy_pick.split(":")[1]))
    # A chain is paced by what its step costs; no plan at all (None) is plain decoding, unpaced.
    if sampled_pick is None:
        assert sampling is None
    else:
        assert (sampling.spec, sampling.step_cost) == (sampled_pick, COST.at(int(sampled_pick.split(":")[1])))


def test_a_drafter_measured_nowhere_drafts_its_chain_greedy_and_decodes_plain_sampling():
    assert auto_tree(4, "cpu", None, cost=COST) == "chain:4"
    assert auto_tree(4, "cpu", None, sampling=True, cost=COST) is None


def test_other_trees_are_taken_as_given(tmp_path, fake_cost):
    drafter = heads(tmp_path, {"val_chain_tau_by_depth": GREEDY, "val_sampled_chain_tau_by_depth": {"1": SAMPLED_WEAK}})
    plan = factory.plan_tree(None, drafter, None, tree="chain:2", greedy=False, step_cost="auto")
    assert (plan.spec, plan.tree, plan.step_cost, plan.draft_vocab) == ("chain:2", chain(2), None, None)
