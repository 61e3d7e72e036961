"""Smoke test of `python -m infer.benchmark` on the shipped reference model with tiny settings: it runs
every mode (engine, transformers peer, --shape), its JSON has the documented fields, and nothing is timed."""

import argparse
import json
import math
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

from clover_jax.io.hf import load_pretrained
from clover_jax.engine.decode import Generator
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.trees.static import Tree
from clover_jax.trees.fit import fit_to_hits
from clover_jax.plan.factory import load_drafter
from clover_jax.trees.spec import resolve_tree
from conftest import tiny_llama_checkpoint
from clover_jax import _cli as cli
from infer import benchmark, profiling, report, tasks
from clover_jax.io import sources
from clover_jax.io import tokenization


@pytest.mark.slow
def test_benchmark_runs_and_reports(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = benchmark.main(["--methods", "plain,medusa,clover2", "--num-prompts", "3", "--batch-sizes", "1",
                           "--max-new-tokens", "6", "--repeats", "1", "--tree", "medusa=chain:2", "--tree", "medusa=chain:1",
                           "--tree", "clover2=default", "--hf",
                           "--shape", "tiny", "--shape-layers", "1", "--json", str(out), "--plot", str(png),
                           "--profile", str(tmp_path / "profile")])
    assert code == 0
    result = json.loads(out.read_text())
    # --profile: a Perfetto trace per method of the first batch size, and its costliest XLA ops per step
    profile = result["profile"]
    assert set(profile) == {"plain", "medusa chain:2", "medusa chain:1", "clover2 default"}
    for name, ops in profile.items():
        assert ops and all(op["us_per_step"] > 0 and op["calls_per_step"] > 0 for op in ops)
        assert ops == sorted(ops, key=lambda op: -op["us_per_step"])
        assert not any(op["op"].startswith("while") for op in ops)  # a loop's time is its body's
        assert all(op["shape"] and op["source"] for op in ops)  # each named by its shape and source
        folder = tmp_path / "profile" / profiling.profile_folder(name)
        assert list(folder.glob("**/*perfetto_trace.json.gz"))
    assert profiling.profile_folder("medusa trees/my tree.json dv=32768") == "medusa_trees_my_tree.json_dv=32768"
    rows = {(r["method"], r["tree"], r["batch_size"]): r for r in result["results"]}
    configs = [("plain", ""), ("medusa", "chain:2"), ("medusa", "chain:1"), ("clover2", "default"), ("hf-generate", "")]
    # (Batch sizes after the first: test_benchmark_reports_spec_bench_tasks.)
    assert set(rows) == {(m, t, 1) for m, t in configs} | {("hf-prompt-lookup", "", 1)}
    for (method, _, b), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and r["new_tokens"] == 3 * 6
        assert r["matches_plain"] is not False  # greedy: every method writes plain decoding's tokens
        assert r["at_eos"] is None  # no --stop-at-eos: every answer runs to the budget, none is counted
        if not method.startswith("hf-"):
            assert r["tau"] >= 1 and r["compilations"] == r["buckets"] >= 1
    assert rows[("plain", "", 1)]["tau"] == 1.0 and rows[("plain", "", 1)]["speedup"] == 1.0
    assert rows[("medusa", "chain:2", 1)]["tree_nodes"] == 3 and len(rows[("medusa", "chain:2", 1)]["accept_per_depth"]) == 2
    assert rows[("medusa", "chain:1", 1)]["tree_nodes"] == 2
    assert len(rows[("clover2", "default", 1)]["accept_per_depth"]) == 5
    eff = result["plain_efficiency"]
    assert eff["bandwidth_bytes_per_s"] > 0 and 0 < eff["fraction_of_bandwidth"] and eff["weight_bytes"] > 8e6
    # One ratio per timed pass (repeats=1 here), against the streaming reads taken during that pass.
    assert len(eff["passes"]) == 1 and eff["passes"][0]["fraction_of_bandwidth"] == eff["fraction_of_bandwidth"]
    assert eff["limit_step_ms"] == pytest.approx(1e3 * eff["bytes_per_step"] / eff["bandwidth_bytes_per_s"])
    # The decoding loop, timed apart from the prefill, takes one step per token after the first.
    assert eff["decode_steps"] == 3 * 5 and eff["decode_step_ms"] > 0 and eff["prefill_ms_per_prompt"] > 0
    shape = result["shape"]
    assert shape["layers"] == 1
    assert set(shape["methods"]) == {"plain", "medusa chain:2", "medusa chain:1", "clover2 default"}
    # Steps are timed as the whole generation less the prefill run alone (a budget of one token), so
    # each row counts the loop's steps: plain takes one per token after the first. Five tiny steps are
    # within timing noise of the prefill, so only finiteness is asserted of the times.
    assert shape["methods"]["plain"]["loop_steps"] == 5
    assert all(1 <= s["loop_steps"] <= 5 and s["prefill_ms"] > 0 for s in shape["methods"].values())
    assert all(math.isfinite(s["step_ms"]) and math.isfinite(s["projected_speedup"]) for s in shape["methods"].values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "profile, clover2 default (batch 1): most costly operations per step" in table
    assert "hf-prompt-lookup" in table and "of the limit" in table and "projected speedup" in table


@pytest.mark.slow
def test_default_tree_is_auto_and_each_row_names_the_tree_it_used(tmp_path, capsys):
    """No --tree: each method's `auto` tree, resolved as infer.generate resolves it (on this CPU a chain
    through every head for heads that record no held-out tau per depth, as the reference model's), and
    the row, the table and the JSON name it; `default` is the paper tree. --step-cost auto paces that
    chain by the CPU's cost of it, none not at all: a row each, both writing plain decoding's tokens."""
    assert benchmark._configs([], ["plain", "clover2"]) == [("plain", None), ("clover2", "auto")]
    path = sources.model_dir(None)
    _, model = load_pretrained(path)
    heads = path / "heads" / "medusa"
    plan = lambda spec, heads_dir, sampling=False, cost="auto": benchmark.planned(
        model, load_drafter(model, "medusa", heads=heads_dir), spec, cost, "auto", sampling)
    assert plan("auto", heads) == ("chain:4", 1.71) and plan(None, heads) == (None, None)
    recorded = tmp_path / "medusa"  # heads recording their held-out tau per depth: auto reads it
    shutil.copytree(heads, recorded)
    meta = json.loads((recorded / "heads.json").read_text())
    meta["held_out"]["val_chain_tau_by_depth"] = [1.3, 1.37, 1.38, 1.39]
    (recorded / "heads.json").write_text(json.dumps(meta))
    assert plan("auto", recorded) == ("chain:1", 1.29) and plan("auto", recorded, cost="none") == ("chain:1", None)
    assert plan("auto", recorded, sampling=True) == ("plain", None)  # 1.3 < a 1.39 step
    out = tmp_path / "bench.json"
    assert benchmark.main(["--methods", "plain,clover2", "--num-prompts", "1", "--batch-sizes", "1",
                           "--max-new-tokens", "3", "--repeats", "1", "--step-cost", "auto,none", "--json", str(out)]) == 0
    paced, unpaced = [r for r in json.loads(out.read_text())["results"] if r["method"] == "clover2"]
    assert (paced["tree"], paced["tree_nodes"], paced["matches_plain"]) == ("chain:5 paced 1.85", 6, True)
    assert (unpaced["tree"], unpaced["tree_nodes"], unpaced["matches_plain"]) == ("chain:5", 6, True)
    assert (paced["step_cost"], unpaced["step_cost"], unpaced["drafted"]) == (1.85, None, 1.0)
    assert 0 < paced["drafted"] <= 1  # the first step drafts (the running mean starts at what pays)
    table = capsys.readouterr().out
    assert "chain:5 paced 1.85 (6)" in table and "chain:5 (6)" in table
    # The unpaced chain's step cost in plain steps (a paced row's mixes in plain steps).
    costs = next(line for line in table.splitlines() if line.startswith("a chain step in this run, in plain steps"))
    assert re.search(r": clover2 chain:5 \(batch 1, T=0\) \d+\.\d\d \(--tree auto times its own", costs), costs
    # Sampling, the recorded heads' one draft (1.3 tokens) does not pay for its step (1.39): a plain row.
    assert benchmark.main(["--methods", "medusa", "--num-prompts", "1", "--batch-sizes", "1", "--max-new-tokens", "3",
                           "--repeats", "1", "--temperatures", "1", "--heads-root", str(tmp_path),
                           "--json", str(out)]) == 0
    [row] = [r for r in json.loads(out.read_text())["results"] if r["method"] == "medusa"]
    assert (row["tree"], row["tree_nodes"], row["step_cost"], row["tau"]) == ("plain", 1, None, 1.0)


@pytest.mark.slow
def test_repeats_0_times_the_one_pass_it_makes(tmp_path, monkeypatch):
    """--repeats 0: each engine makes one pass over the prompts, which gives tau, the tokens and the
    times (compiling left out); the bandwidth line's own programs still compile in an untimed pass, over
    a sample of the prompts (here the first 2 of 3)."""
    passes = []
    real = benchmark.engine_pass
    monkeypatch.setattr(benchmark, "engine_pass", lambda *a, **k: passes.append(real(*a, **k)) or passes[-1])
    monkeypatch.setattr(benchmark, "SAMPLE_PROMPTS", 2)
    out = tmp_path / "r.json"
    assert benchmark.main(["--methods", "plain,medusa", "--num-prompts", "3", "--batch-sizes", "1,2",
                           "--max-new-tokens", "4", "--repeats", "0", "--tree", "chain:2", "--json", str(out)]) == 0
    assert len(passes) == 4  # two engines, two batch sizes, one pass each
    assert all(out.state is None for outs in passes for out in outs)  # no batch's KV cache is kept
    result = json.loads(out.read_text())
    assert result["settings"]["repeats"] == 0
    for r in result["results"]:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["speedup"] > 0 and r["new_tokens"] == 3 * 4
        assert r["tau"] >= 1 and r["matches_plain"] is not False
    eff = result["plain_efficiency"]
    assert len(eff["passes"]) == 1 and eff["decode_step_ms"] > 0
    assert eff["prompts"] == 2 and eff["decode_steps"] == 2 * 3  # the sample's, one step per token after the first


@pytest.mark.parametrize("args, message", [
    (["--methods", "plain,eagle-9"], "unknown method 'eagle-9'"),
    (["--batch-sizes", "1,zero"], "--batch-sizes '1,zero': expected comma-separated integers"),
    (["--batch-sizes", "0"], "give one or more integers >= 1"),
    (["--repeats", "-1"], "--repeats -1 must be >= 0"),
    (["--temperatures", "0,hot"], "expected comma-separated numbers"),
    (["--draft-temperature", "0"], "draft_temperature=0.0 must be > 0"),
    (["--tree", "plain=chain:2"], "plain decoding has no tree"),
    (["--methods", "medusa", "--draft-vocab", "many"], "--draft-vocab 'many': give auto, 0"),
    (["--prompts", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["--turns", "all"], "--turns all asks later turns after the conversation so far, as the chat template renders "
                         "it; add --chat"),
    (["--per-task", "0"], "--per-task 0 must be >= 1"),
    (["--buckets", "512,many"], "--buckets '512,many': expected comma-separated integers"),
    (["--methods", "medusa", "--step-cost", "auto,0"], "--step-cost '0': write auto, none, or a speculative step's"),
    (["--per-task", "2"], "--per-task: no record of the prompts file names a \"category\""),
    (["--methods", "clover", "--fit-tree", "4"], "--fit-tree N and --tree-out FILE go together"),
    (["--methods", "medusa,clover", "--fit-tree", "4", "--tree-out", "/tmp/t.json"],
     "--fit-tree fits one run's accepted paths, and this one drafts in 2 configuration(s) at 1 temperature(s) and 2 "
     "batch size(s)"),
    (["--methods", "clover", "--tree", "chain:2", "--batch-sizes", "1", "--temperatures", "0,1", "--fit-tree", "2",
      "--tree-out", "/tmp/t.json"], "drafts in 2 configuration(s) at 2 temperature(s) and 1 batch size(s)"),
    (["--methods", "clover", "--tree", "chain:2", "--batch-sizes", "1", "--fit-tree", "4", "--tree-out", "/tmp/t.json"],
     "--fit-tree 4: the run's tree has 3 nodes; fit fewer, or draft a larger tree"),
    (["--methods", "clover", "--tree", "dynamic:8", "--batch-sizes", "1", "--fit-tree", "4", "--tree-out",
      "/tmp/t.json"], "--fit-tree: a dynamic tree's nodes are other paths every step"),
])
def test_benchmark_bad_input_is_one_line(args, message, capsys):
    assert benchmark.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_output_paths_are_checked_before_anything_runs(tmp_path, capsys):
    """A path that --json, --plot or --profile could not write to is one error line before anything is
    timed, not a failure after the whole run; a folder still to be made is made when written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, message in ((["--json", str(blocker / "out.json")], f"--json: cannot create the folder {blocker}: "),
                          (["--plot", str(tmp_path)], f"--plot {tmp_path} is a folder; give a file path"),
                          (["--plot", str(tmp_path / "p.pngg")], f"--plot {tmp_path / 'p.pngg'}: cannot write a .pngg image; "),
                          (["--profile", str(blocker / "traces")], f"--profile: cannot create the folder {blocker}")):
        assert benchmark.main(["--num-prompts", "1", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {message}"), err
    out = tmp_path / "new" / "deeper" / "r.json"
    benchmark._check_outputs(argparse.Namespace(json=str(out), plot=None, profile=str(tmp_path / "traces"),
                                                fit_tree=None, tree_out=None))
    assert not (tmp_path / "new").exists() and not (tmp_path / "traces").exists()  # checked, not made
    report.write_json({"results": []}, str(out))
    assert json.loads(out.read_text()) == {"results": []}


@pytest.mark.parametrize("temperature", ["0", "1"])
@pytest.mark.slow
def test_fit_tree_keeps_the_nodes_where_the_runs_drafts_were_accepted(tmp_path, capsys, temperature):
    """--fit-tree N: a row on a static tree records each node's hits (the root's: its drafting steps;
    a depth's together: the steps accepting that deep or deeper), and the N-node subtree that held the
    most of them is written to --tree-out, for --tree FILE; greedy and sampled."""
    out, tree_out = tmp_path / "b.json", tmp_path / "fit.json"
    assert benchmark.main(["--methods", "clover2", "--num-prompts", "3", "--batch-sizes", "1", "--max-new-tokens",
                           "12", "--repeats", "0", "--temperatures", temperature, "--tree", "default",
                           "--fit-tree", "8", "--tree-out", str(tree_out), "--json", str(out)]) == 0
    [row] = [r for r in json.loads(out.read_text())["results"] if r["method"] == "clover2"]
    hits, run = row["node_hits"], resolve_tree("default", "clover2", 5)
    assert len(hits) == row["tree_nodes"] == run.num_nodes and hits[0] == row["steps"] - 3  # the prefills apart
    for d in range(1, 6):
        assert sum(hits[i] for i in run.depth_nodes[d - 1]) == round(row["accept_per_depth"][d - 1] * hits[0])
    fitted = Tree.from_file(str(tree_out))
    assert fitted == fit_to_hits(run, hits, 8) and fitted.num_nodes == 8 and set(fitted.paths) <= set(run.paths)
    saved = json.loads(tree_out.read_text())
    assert saved["method"] == "clover2" and saved["temperature"] == float(temperature) and saved["steps"] == hits[0]
    assert f"fitted tree (8 nodes, depth {fitted.max_depth}) written to {tree_out}" in capsys.readouterr().out


@pytest.mark.slow
def test_benchmark_sampling_and_draft_vocabulary_rows(tmp_path):
    """--temperatures adds sampled rows (speculative sampling: tau >= 1, no token-equality claim), and
    --draft-vocab one row per vocabulary: auto is the shipped heads' 128 tokens when greedy and the whole
    vocabulary when sampling; --shape drafts from N tokens of its own vocabulary. --chat and --system
    prompt through the chat template, and the settings say so."""
    out = tmp_path / "bench.json"
    assert benchmark.main(["--methods", "plain,medusa", "--tree", "chain:1", "--num-prompts", "1", "--batch-sizes", "1",
                           "--max-new-tokens", "4", "--repeats", "1", "--temperatures", "0,1",
                           "--draft-vocab", "0,auto,160", "--shape", "tiny", "--shape-layers", "1",
                           "--chat", "--system", "be brief", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["settings"]["chat"], result["settings"]["system"]) == (True, "be brief")
    rows = {(r["method"], r["temperature"], r["draft_vocab"]): r for r in result["results"]}
    spec = [("medusa", t, dv) for t in (0.0, 1.0) for dv in ("0", "auto", "160")]
    assert set(rows) == {("plain", 0.0, ""), ("plain", 1.0, "")} | set(spec)
    sizes = {k: rows[k]["draft_vocab_size"] for k in spec}
    assert sizes == {("medusa", 0.0, "0"): 0, ("medusa", 0.0, "auto"): 128, ("medusa", 0.0, "160"): 160,
                     ("medusa", 1.0, "0"): 0, ("medusa", 1.0, "auto"): 0, ("medusa", 1.0, "160"): 160}
    assert all(rows[k]["matches_plain"] is True for k in spec if k[1] == 0)
    assert all(rows[k]["matches_plain"] is None and rows[k]["tau"] >= 1 for k in spec if k[1] == 1)
    assert rows[("plain", 1.0, "")]["speedup"] == 1.0
    shape = result["shape"]["methods"]
    assert {m: s["draft_vocab_size"] for m, s in shape.items()} == {
        "plain": 0, "medusa chain:1 dv=0": 0, "medusa chain:1": 0, "medusa chain:1 dv=160": 160}


@pytest.mark.slow
def test_later_turns_are_asked_after_plain_greedy_answers(tmp_path, capsys, monkeypatch):
    """--chat: a multi-turn record's later turns are measured too, each asked after the conversation so
    far with plain greedy decoding's answers in it, as Spec-Bench asks MT-Bench's second questions.
    Only the turns a later one follows are answered there: the last turn's answers are the measured ones."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)
    tok = cli.load_tokenizer(model_dir)
    odd = list(range(1, tok.vocab_size, 2))  # odd ids end an answer: answers that end, so turns follow
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": odd}))
    records = [{"turns": ["x = 1", "y?"], "category": "writing"}, {"prompt": "z", "category": "qa"},
               {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a"},
                                  {"from": "gpt", "value": "not this answer"}, {"from": "human", "value": "b"}]}]
    systems = [None, None, "be brief"]
    model = load_pretrained(model_dir)[1]
    eos = tokenization.eos_ids(model_dir, model.cfg, tok)
    firsts = [tokenization.encode(tok, text, chat=True, system=system) for text, system in zip(("x = 1", "z", "a"), systems)]
    answered = []
    real_generate = Generator.generate
    monkeypatch.setattr(Generator, "generate",
                        lambda self, prompts, *a, **k: answered.extend(prompts) or real_generate(self, prompts, *a, **k))
    prompts, owners = benchmark.with_later_turns(model, tok, firsts, [(r, f"q:{i}") for i, r in enumerate(records)],
                                                 systems, 6, eos, 2)
    monkeypatch.setattr(Generator, "generate", real_generate)
    assert answered == firsts[::2]  # the two-turn records' first turns, in one batch of two
    assert len(prompts) == 5 and prompts[:3] == firsts and owners == [0, 1, 2, 0, 2]
    gen = Generator(model)
    for later, first, (said, then), system in zip(prompts[3:], firsts[::2], [("x = 1", "y?"), ("a", "b")],
                                                  systems[::2]):
        answer = gen.generate([first], 6, eos_ids=eos).tokens[0]
        assert answer[-1] in eos
        messages = tokenization.chat_messages([(said, tok.decode(answer[:-1], skip_special_tokens=True))], then, system)
        assert tok.decode(later) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The command measures all five, and says so; --turns first keeps the three first turns.
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    for turns, count in (("all", 5), ("first", 3)):
        out = tmp_path / f"{turns}.json"
        assert benchmark.main(["--model", str(model_dir), "--methods", "plain", "--prompts", str(path), "--chat",
                               "--turns", turns, "--batch-sizes", "2", "--max-new-tokens", "6", "--repeats", "1",
                               "--no-stop-at-eos", "--json", str(out)]) == 0
        settings = json.loads(out.read_text())["settings"]
        assert settings["num_prompts"] == count and settings["num_records"] == 3 and settings["turns"] == turns
        assert json.loads(out.read_text())["results"][0]["new_tokens"] == count * 6
        per_task = json.loads(out.read_text())["results"][0]["per_task"]  # a later turn is its record's task's
        assert {t: f["prompts"] for t, f in per_task.items()} == {"mt_bench": 2 if turns == "all" else 1, "qa": 1}


@pytest.mark.slow
def test_one_bucket_compiles_one_program_per_method(tmp_path):
    """--buckets 512: every prompt is padded to 512 tokens, so each method compiles once, where the default
    buckets take one program per prompt length class; the tokens stay plain decoding's."""
    prompts = tmp_path / "p.jsonl"  # 8, 80 and 280 tokens: three of the default buckets
    prompts.write_text("".join(json.dumps({"prompt": "def f(x):\n    return x" * n}) + "\n" for n in (1, 10, 35)))
    counts = {}
    for flag in ([], ["--buckets", "512"]):
        out = tmp_path / f"b{len(flag)}.json"
        assert benchmark.main(["--methods", "plain,medusa", "--tree", "chain:2", "--prompts", str(prompts),
                               "--batch-sizes", "1", "--max-new-tokens", "4", "--repeats", "1", *flag,
                               "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["settings"]["buckets"] == ([512] if flag else None)
        assert all(r["matches_plain"] is not False for r in result["results"])
        counts[bool(flag)] = [(r["compilations"], r["buckets"]) for r in result["results"]]
    assert counts[True] == [(1, 1), (1, 1)]
    assert counts[False] == [(3, 3), (3, 3)]


def test_per_task_figures_are_each_tasks_own_prompts_and_batches():
    """Spec-Bench's tasks: tau and tokens/s over each task's prompts alone; a time only where no batch
    mixes in another task's prompts."""
    assert [tasks.task_of(r) for r in ({"category": "writing"}, {"category": "humanities"},
                                           {"category": "math_reasoning"}, {"category": ""}, {})] == \
        ["mt_bench", "mt_bench", "math_reasoning", None, None]
    seconds = [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]  # two timed passes, a time per batch of one
    got = tasks.per_task(["a", "a", "b"], [4, 4, 4], [2, 2, 4], seconds, 1)
    assert got == {"a": dict(prompts=2, tau=2.0, new_tokens=8, tokens_per_s=8 / 4.0),  # median(1+2, 3+2) s
                   "b": dict(prompts=1, tau=1.0, new_tokens=4, tokens_per_s=4 / 2.0)}  # median(3, 1) s
    assert tasks.per_task(["a", "a", "b"], [4, 4, 4], [2, 2, 4], [[1.0, 3.0], [3.0, 1.0]], 2)["a"][
        "tokens_per_s"] == 8 / 2.0
    mixed = tasks.per_task(["a", "b", "b", None], [4] * 4, [2] * 4, [[1.0, 1.0]], 2)
    assert mixed["a"]["tokens_per_s"] is None and mixed["b"]["tokens_per_s"] is None and set(mixed) == {"a", "b"}
    # --per-task N: the first N records of each task, in the file's order
    records = [({"category": c, "turns": [str(i)]}, f"q:{i}") for i, c in
               enumerate(["writing", "math", "writing", "qa", "humanities", "qa", "qa"])] + [({"prompt": "x"}, "q:7")]
    assert [w for _, w in tasks.first_of_each_task(records, 2)] == ["q:0", "q:1", "q:3", "q:5"]  # math is MT-Bench's


@pytest.mark.slow
def test_benchmark_reports_spec_bench_tasks(tmp_path, capsys):
    records = [{"question_id": 1, "category": "writing", "turns": ["def add(a, b):"]},
               {"question_id": 2, "category": "roleplay", "turns": ["class Point:"]},
               {"question_id": 3, "category": "translation", "turns": ["import os"]}]
    path, out, png = tmp_path / "question.jsonl", tmp_path / "b.json", tmp_path / "b.png"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert benchmark.main(["--methods", "plain,medusa", "--tree", "chain:2", "--prompts", str(path),
                           "--batch-sizes", "1,3", "--max-new-tokens", "6", "--repeats", "1", "--json", str(out),
                           "--plot", str(png), "--hf"]) == 0
    rows = {(r["method"], r["batch_size"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(m, b) for m in ("plain", "medusa", "hf-generate") for b in (1, 3)} | {("hf-prompt-lookup", 1)}
    for (method, b), r in rows.items():
        tasks = r["per_task"]
        assert {t: f["prompts"] for t, f in tasks.items()} == {"mt_bench": 2, "translation": 1}
        assert sum(f["new_tokens"] for f in tasks.values()) == r["new_tokens"] == 18
        taus = [f["tau"] for f in tasks.values()]
        assert taus == [None, None] if method.startswith("hf-") else all(t >= 1 for t in taus)
        assert method != "plain" or taus == [1, 1]
        if b == 1:  # a batch per prompt: each task's time is its own
            assert all(f["tokens_per_s"] > 0 and f["speedup"] > 0 for f in tasks.values())
            assert method != "plain" or all(f["speedup"] == 1 for f in tasks.values())
        else:  # one batch holds both tasks: tau only
            assert all(f["tokens_per_s"] is None and f["speedup"] is None for f in tasks.values())
    text = capsys.readouterr().out
    assert "speedup over plain (tau) per task; prompts: mt_bench 2, translation 1" in text
    assert "per task, batch 3" in text and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_stop_at_eos_ends_each_answer_where_the_model_does(tmp_path, capsys):
    """--chat stops each answer at the model's EOS, as Spec-Bench does (--no-stop-at-eos: exactly
    --max-new-tokens); the transformers rows stop there too and write the same tokens, and every row
    counts the answers that got to EOS."""
    model_dir = tiny_llama_checkpoint(tmp_path / "model", max_position_embeddings=128)
    tok = cli.load_tokenizer(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1, tok.vocab_size, 2))}))
    texts = ["x = 1", "def f():", "import os"]
    path, out = tmp_path / "q.jsonl", tmp_path / "r.json"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    assert benchmark.main(["--model", str(model_dir), "--methods", "plain", "--prompts", str(path), "--chat",
                           "--batch-sizes", "1,2", "--max-new-tokens", "8", "--repeats", "1", "--hf",
                           "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    model = load_pretrained(model_dir)[1]
    eos = tokenization.eos_ids(model_dir, model.cfg, tok)
    answers = Generator(model).generate([tokenization.encode(tok, t, chat=True) for t in texts], 8, eos_ids=eos).tokens
    assert all(a[-1] in eos for a in answers) and sum(map(len, answers)) < 3 * 8  # the seed gives early ends
    assert result["settings"]["stop_at_eos"] is True
    for r in result["results"]:
        assert r["new_tokens"] == sum(map(len, answers)), r["method"]
        assert r["matches_plain"] is not False
        assert r["at_eos"] == 3, r["method"]
    assert "answers that ended at EOS, of 3 (the rest ran to --max-new-tokens 8): plain 3, hf-generate 3" \
        in capsys.readouterr().out
    assert {r["method"] for r in result["results"]} == {"plain", "hf-generate", "hf-prompt-lookup"}


def test_acceptance_curves_merge_draft_vocabularies_that_accept_alike():
    """The plot draws one curve for rows that differ only in their draft vocabulary when they accept
    alike, and keeps both, named apart, when they do not."""
    row = lambda method, tree, dv, accept, t=0.0: report.Row(method=method, batch_size=1, tree=tree, draft_vocab=dv,
                                                                accept_per_depth=accept, temperature=t)
    rows = [row("medusa", "chain:2", "0", [0.8, 0.6]), row("medusa", "chain:2", "auto", [0.8, 0.6]),
            row("clover2", "default", "0", [0.9, 0.7]), row("clover2", "default", "auto", [0.9, 0.8]),
            row("clover2", "default", "auto", [0.5, 0.3], t=1.0)]
    names = [name for name, _ in report.acceptance_curves(rows)]
    assert names == ["medusa chain:2", "clover2 default dv=0", "clover2 default", "clover2 default T=1"]


def test_hlo_sources_name_what_an_operation_computes():
    """A profile's operation names (`dot.3`, `ynn_fusion.25`) are looked up in the optimized HLO: the
    result shape and the JAX operation, or for a fusion the one inside it."""
    text = jax.jit(lambda x, w: jnp.tanh(jnp.einsum("nd,df->nf", x, w))).lower(
        jnp.ones((2, 4)), jnp.ones((4, 3))).compile().as_text()
    sources = profiling.hlo_sources(text)
    assert any(shape == "f32[2,3]" and "dot" in source for shape, source in sources.values())
    assert all(name and shape for name, (shape, _) in sources.items())
    # A fusion without its own source takes its computation's.
    fused = "%fused_computation.7 (p: f32[2]) -> f32[2] {\n  ROOT %e.1 = f32[2]{0} exponential(%p), metadata={op_name=\"jit(f)/exp\"}\n}\n"
    entry = "ENTRY %main.2 (a: f32[2]) -> f32[2] {\n  ROOT %loop_fusion.3 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused_computation.7\n}\n"
    assert profiling.hlo_sources(fused + entry)["loop_fusion.3"] == ("f32[2]", "exp")


def test_exactness_note_only_where_numerics_explain_a_difference():
    """A bfloat16 row that parts from plain decoding gets the rounding explanation; float32 never does
    (there a difference is a bug, and the table says OUTPUT DIFFERS FROM PLAIN)."""
    same, differs = report.Row("clover2", 1, matches_plain=True), report.Row("clover2", 1, matches_plain=False)
    assert report.exactness_note([same], "bfloat16") is None
    assert report.exactness_note([same, differs], "float32") is None
    assert "rounds some logits differently" in report.exactness_note([same, differs], "bfloat16")
    assert "OUTPUT DIFFERS FROM PLAIN" in report.format_table([differs])


def test_mt_bench_alone_is_broken_down_by_its_categories():
    """--prompts mt-bench: each of MT-Bench's categories is a task, as the Clover-2 paper's table has them;
    beside other Spec-Bench tasks, MT-Bench is one task again."""
    records = [({"category": c, "turns": [str(i)]}, f"q:{i}") for i, c in
               enumerate(["writing", "math", "writing", "coding", "stem"])]
    assert tasks.tasks_of(records) == ["writing", "math", "writing", "coding", "stem"]
    assert [w for _, w in tasks.first_of_each_task(records, 1)] == ["q:0", "q:1", "q:3", "q:4"]
    mixed = records + [({"category": "qa", "turns": ["x"]}, "q:5")]
    assert tasks.tasks_of(mixed) == ["mt_bench"] * 5 + ["qa"]


def test_profiling_traces_the_program_the_timed_runs_compiled(tmp_path):
    """--profile with answers that end at EOS (--chat, --stop-at-eos) traces the program the timed runs
    compiled: profiling them without their EOS compiled another (tens of seconds a program on a GPU)."""
    _, model = load_pretrained(sources.DEFAULT_MODEL_DIR)
    gen = Generator(model)
    prompts, eos = [[5, 6, 7, 8]], (2,)
    gen.generate(prompts, 4, eos_ids=eos, batch_size=1)
    before = gen.compilations
    ops = profiling.profile_ops(gen, prompts, 4, SamplingConfig(), 0, tmp_path, batch_size=1, eos_ids=eos)
    assert ops and gen.compilations == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_greedy_row_that_parts_from_plain_is_recorded_and_in_float32_fails_the_run(dtype, tmp_path, capsys, monkeypatch):
    """Each greedy row counts the prompts whose text is plain decoding's and records, per prompt, where
    the others first parted (token index, the two tokens, the base model's gap there). A speculative row
    made to part at token 2 of the first prompt: in bfloat16 the run records it and succeeds; in float32,
    where greedy output must be plain decoding's, it records it too, writes its JSON, and exits 1."""
    measure = benchmark.run_engines

    def parting(*args, **kw):
        measured = measure(*args, **kw)
        for name, (stats, tokens) in measured.items():
            if name != "plain":
                tokens[0] = tokens[0][:2] + [(tokens[0][2] + 1) % 64] + tokens[0][3:]
        return measured

    monkeypatch.setattr(benchmark, "run_engines", parting)
    out = tmp_path / "bench.json"
    code = benchmark.main(["--methods", "plain,medusa", "--num-prompts", "2", "--batch-sizes", "1", "--max-new-tokens",
                           "4", "--repeats", "0", "--tree", "chain:1", "--dtype", dtype, "--json", str(out)])
    captured = capsys.readouterr()
    assert code == (1 if dtype == "float32" else 0)
    assert ("differs from plain decoding's in float32" in captured.err) == (dtype == "float32")
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["plain"]["same_text"] is None and rows["plain"]["divergences"] is None
    medusa = rows["medusa"]
    assert medusa["matches_plain"] is False and medusa["same_text"] == 1
    first, second = medusa["divergences"]
    assert second is None and (first["index"], first["other"]) == (2, (first["token"] + 1) % 64)
    assert first["gap"] is not None and first["scale"] > 0 and first["ulp"] > 0
    assert "1/2 (at 2, first 2)" in captured.out
    assert ("OUTPUT DIFFERS FROM PLAIN" in captured.out) == (dtype == "float32")
    assert ("the other 1 parts at token 2" in captured.out) == (dtype == "bfloat16")


def test_same_text_cells_and_notes():
    """The `same text` column shows where a run counted texts; the marker for a differing row stays where
    it is a bug (float32) or uncounted; bfloat16's note says where rows parted and how near a tie."""
    near = dict(index=7, token=3, other=4, gap=0.01, top2_gap=0.01, scale=3.0, ulp=0.0156)
    parted = report.Row("clover2", 1, matches_plain=False, same_text=1, divergences=[None, near, dict(near, index=9)])
    same = report.Row("clover2", 1, matches_plain=True, same_text=3, divergences=[None] * 3)
    assert report.same_text_cell(parted) == "1/3 (at 8, first 7)" and report.same_text_cell(same) == "3/3"
    assert report.same_text_cell(report.Row("plain", 1)) == "-"
    assert report.columns(True)[-2:] == ["same text", "accept@1..D"] and report.columns() == list(report.COLUMNS)
    assert report.cells(parted, True)[-2] == "1/3 (at 8, first 7)" and len(report.cells(parted)) == len(report.COLUMNS)
    assert "same text" not in report.format_table([report.Row("plain", 1)])
    assert "OUTPUT DIFFERS" in report.format_table([parted]) and "OUTPUT DIFFERS" not in report.format_table([parted], "bfloat16")
    note = report.exactness_note([same, parted], "bfloat16")
    assert "1 of 3 texts are plain decoding's; the other 2 part at token 8 (median; first 7)" in note
    assert "0.64 spacings apart (median; at most 0.64)" in note
    assert report.strict_note([parted], "bfloat16") is None and "clover2 default (batch 1)" in report.strict_note([parted], "float32")
    assert report.strict_note([report.Row("hf-generate", 1, matches_plain=False)], "float32") is None
