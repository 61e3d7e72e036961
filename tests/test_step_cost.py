"""`--tree auto` on a CPU decides by a chain step's cost timed on this machine, once, and kept.

Nothing here asserts a time: the timing is checked for what it records and where, and the decisions for
following the figure kept (given here by a stand-in for the timing), whatever this machine's is."""

import json
import types

import pytest

from clover_jax.plan import step_cost
from clover_jax.io.heads_dir import CONFIG, save_heads
from clover_jax.io.hf import load_pretrained
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.plan.auto import CPU_CHAIN_COST, ChainCost
from infer import generate


@pytest.fixture(scope="module")
def model(model_dir):
    return load_pretrained(model_dir)[1]


def test_timed_once_kept_per_machine_model_drafter_and_sampling(model, tmp_path, monkeypatch):
    """The first call times plain and chain steps (the two depths a drafter's heads span) and keeps the
    figures under a key naming the machine, model, drafter, draft vocabulary and greedy or sampling; the
    next call reads them without timing; sampling is timed apart (here with one head: one depth, and
    the fitted model's increment per draft); "off" times nothing. The step times are a stand-in's
    (2 ms plain, 2.4 + 0.3 D ms a chain:D step): this tiny model's real steps take microseconds, which a
    busy machine can make come out unusable (the next test), and this one checks what is kept."""
    kept = tmp_path / "costs" / "step-costs.json"
    monkeypatch.setenv(step_cost.COSTS_ENV, str(kept))
    timed = []

    def seconds_per_step(generator, sampling):
        timed.append((type(generator).__name__, getattr(generator, "tree", None), sampling.temperature))
        return 2e-3 if len(timed) == 1 else 2.4e-3 + 0.3e-3 * generator.tree.max_depth

    monkeypatch.setattr(step_cost, "seconds_per_step", seconds_per_step)
    heads = make_heads(drafter_config("medusa", 3), model, seed=1)
    cost = step_cost.chain_cost(model, heads, None, sampling=False)
    assert [(name, None if tree is None else tree.max_depth, t) for name, tree, t in timed] == [
        ("Generator", None, 0.0), ("SpeculativeGenerator", 1, 0.0), ("SpeculativeGenerator", 3, 0.0)]
    [(key, entry)] = json.loads(kept.read_text()).items()
    assert key == step_cost.entry_key(model, heads, None, False)
    assert step_cost.machine() in key and "MedusaHeads 3 heads, drafting from all tokens | greedy" in key, key
    assert entry == {"plain_ms": 2.0, "chain": {"1": 1.35, "3": 1.65}, "base": 1.2, "per_draft": 0.15}
    assert cost == ChainCost(1.2, 0.15) and cost.at(1) == pytest.approx(1.35)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    real = step_cost.measure
    monkeypatch.setattr(step_cost, "measure", no_timing)
    assert step_cost.chain_cost(model, heads, None, sampling=False) == cost
    monkeypatch.setattr(step_cost, "measure", real)
    timed.clear()
    step_cost.chain_cost(model, make_heads(drafter_config("medusa", 1), model), None, sampling=True)
    assert [(name, t) for name, _, t in timed] == [("Generator", 1.0), ("SpeculativeGenerator", 1.0)]
    entries = json.loads(kept.read_text())
    assert sorted(k.rsplit(" | ", 1)[1] for k in entries) == ["greedy", "sampling"]
    [one] = [e for k, e in entries.items() if "MedusaHeads 1 heads" in k]
    assert set(one["chain"]) == {"1"} and one["per_draft"] == CPU_CHAIN_COST.per_draft
    monkeypatch.setenv(step_cost.COSTS_ENV, "off")
    assert step_cost.costs_path() is None and step_cost.chain_cost(model, heads, None, sampling=False) is None


def test_a_busy_machines_unusable_timing_is_taken_again_then_left_to_the_fitted_model(model, tmp_path, monkeypatch,
                                                                                     capsys):
    """A long run timed no slower than the short one gives a step of no time: the median is taken again
    (`ROUNDS`); where it stays so, the fitted model decides and nothing is kept, so the next run times again."""
    class Runs:  # a stand-in generator: the first round's long runs as fast as its short ones, then 1 ms a step
        cfg = model.cfg

        def __init__(self):
            self.calls = 0

        def generate(self, prompt, budget, sampling, eos_ids, budgets):
            self.calls += 1
            first_round = self.calls <= 2 * step_cost.REPEATS
            steps = budgets[0]
            return types.SimpleNamespace(steps=steps, run_seconds=0.5 if first_round else 1e-3 * steps)

    runs = Runs()
    assert step_cost.seconds_per_step(runs, None) == pytest.approx(1e-3) and runs.calls == 4 * step_cost.REPEATS
    kept = tmp_path / "step-costs.json"
    monkeypatch.setenv(step_cost.COSTS_ENV, str(kept))
    monkeypatch.setattr(step_cost, "seconds_per_step", lambda generator, sampling: -1e-4)
    heads = make_heads(drafter_config("clover2", 2), model)
    assert step_cost.chain_cost(model, heads, None, sampling=False) is None and not kept.exists()
    assert "the timing came out unusable (is the machine busy?)" in capsys.readouterr().err


def test_a_broken_costs_file_is_timed_again_and_rewritten(model, tmp_path, monkeypatch):
    kept = tmp_path / "step-costs.json"
    kept.write_text("{not json")
    monkeypatch.setenv(step_cost.COSTS_ENV, str(kept))
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: {"plain_ms": 1.0, "chain": {"1": 1.2}, "base": 1.06,
                                                               "per_draft": 0.14})
    heads = make_heads(drafter_config("clover2", 1), model)
    assert step_cost.chain_cost(model, heads, None, sampling=False) == ChainCost(1.06, 0.14)
    assert list(json.loads(kept.read_text()).values()) == [{"plain_ms": 1.0, "chain": {"1": 1.2}, "base": 1.06,
                                                            "per_draft": 0.14}]


@pytest.mark.parametrize("bad", [{"base": "abc", "per_draft": 0.14}, {"base": 1.1, "per_draft": None},
                                 {"base": float("nan"), "per_draft": 0.1}, {"base": -1, "per_draft": 0.1}, [1, 2]])
def test_an_unreadable_kept_entry_is_timed_again_and_replaced(bad, model, tmp_path, monkeypatch):
    """A kept entry that is no chain cost (a hand edit: "base": "abc") is timed again as a missing one,
    not a ValueError on every --tree auto run until the file is deleted; the other entries stay."""
    kept = tmp_path / "step-costs.json"
    monkeypatch.setenv(step_cost.COSTS_ENV, str(kept))
    heads = make_heads(drafter_config("clover2", 1), model)
    key = step_cost.entry_key(model, heads, None, False)
    kept.write_text(json.dumps({key: bad, "another machine": {"base": 1.3, "per_draft": 0.2}}, allow_nan=True))
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: {"plain_ms": 1.0, "chain": {"1": 1.2}, "base": 1.06,
                                                               "per_draft": 0.14})
    assert step_cost.chain_cost(model, heads, None, sampling=False) == ChainCost(1.06, 0.14)
    assert json.loads(kept.read_text()) == {key: {"plain_ms": 1.0, "chain": {"1": 1.2}, "base": 1.06, "per_draft": 0.14},
                                            "another machine": {"base": 1.3, "per_draft": 0.2}}


@pytest.mark.parametrize("base, expected", [(1.05, "tree=2 nodes, depth 1,"), (1.5, "plain decoding (tree auto:")])
def test_generate_auto_follows_the_timed_cost(base, expected, model_dir, model, tmp_path, monkeypatch, capsys):
    """Heads whose one draft brings 1.3 tokens a step: where this machine's chain:1 step costs 1.15
    plain steps they draft, paced by it; where it costs 1.6, plain decoding (the fitted model, 1.29,
    would draft in both)."""
    heads = tmp_path / "heads"
    save_heads(make_heads(drafter_config("medusa", 2), model, seed=1), model, heads)
    meta = json.loads((heads / CONFIG).read_text())
    meta["held_out"] = {"val_chain_tau_by_depth": [1.3, 1.33]}
    (heads / CONFIG).write_text(json.dumps(meta))
    monkeypatch.setenv(step_cost.COSTS_ENV, str(tmp_path / "step-costs.json"))
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: {"plain_ms": 1.0, "chain": {}, "base": base,
                                                               "per_draft": 0.1})
    code = generate.main(["--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "4",
                          "--method", "medusa", "--heads", str(heads)])
    err = capsys.readouterr().err
    assert code == 0 and f"[medusa] {expected}" in err, err
    assert "timing a plain step and chain steps on this CPU, once" in err
    assert f"a chain:D step here costs {base:.2f} + 0.10 D plain steps" in err
    if base < 1.3:
        assert f"paced at {base + 0.1:g} plain steps" in err
