"""`python -m infer.results`: a benchmark JSON becomes a markdown section of docs/results.md, replaced in
place by a rerun, and every section of docs/results.md, and of the history pages its older sections moved
to, is what its command makes from its JSON."""

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from infer import report, results
from infer.report import Row

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "results.md"
# the pages holding rendered sections: docs/results.md and those its older sections moved to
PAGES = [DOC, *(p for p in sorted((REPO / "docs" / "history").glob("*.md")) if "<!-- results:" in p.read_text())]


def write_run(path: Path, rows: list[Row], **settings) -> Path:
    machine = dict(platform="cpu", device="cpu", cpu="Test CPU", cpu_count=2, jax="0.0", date="2026-12-02 10:00 UTC")
    path.write_text(json.dumps({"results": [dataclasses.asdict(r) for r in rows], "machine": machine,
                                "settings": {"dtype": "float32", "command": "python -m infer.benchmark --x", **settings}}))
    return path


def plain(step_ms=2.0, batch=1, **kw):
    return Row("plain", batch, tokens_per_s=100.0, step_ms=step_ms, compile_s=1.0, compilations=1, buckets=1, **kw)


def clover2(step_ms=3.0, batch=1, **kw):
    kw = {"matches_plain": True, **kw}
    return Row("clover2", batch, tree="chain:5", tree_nodes=6, draft_vocab="auto", draft_vocab_size=128, tau=4.35,
               accept_per_depth=[0.92, 0.75], tokens_per_s=139.4, speedup=1.394, step_ms=step_ms, compile_s=2.5,
               compilations=1, buckets=1, drafted=1.0, **kw)


DOC_TEXT = "# Results\n\nintro\n\n<!-- results:one -->\nold table\n<!-- /results:one -->\n\nafter\n"


def test_render_replaces_only_its_section_and_a_rerun_replaces_it_again(tmp_path, capsys):
    doc = tmp_path / "results.md"
    doc.write_text(DOC_TEXT)
    run = write_run(tmp_path / "run.json", [plain(), clover2(matches_plain=False)])
    assert results.main(["render", "one", str(run), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Results\n\nintro\n\n<!-- results:one -->\n| method | batch |")
    assert text.endswith("<!-- /results:one -->\n\nafter\n") and "old table" not in text
    # the rows' cells are the benchmark's own (report.cells), as its terminal table shows them
    assert "| clover2 | 1 | chain:5 (6) | 128 | 4.35 | 139.4 | 1.39x | 3.00 | 2.5 | 1/1 | 100% | 0.92 0.75 " \
           "**output differs from plain** |" in text
    assert report.cells(clover2())[:3] == ["clover2", "1", "chain:5 (6)"]
    assert "Measured 2026-12-02 10:00 UTC on CPU (Test CPU, 2 cores), JAX 0.0, float32" in text
    assert "Command: `python -m infer.benchmark --x`" in text
    write_run(run, [plain(), clover2(step_ms=4.0)])  # a rerun of the benchmark: the section is replaced
    assert results.main(["render", "one", str(run), "--doc", str(doc)]) == 0
    again = doc.read_text()
    assert again.count("<!-- results:one -->") == 1 and again.count("| plain |") == 1 and "| 4.00 |" in again
    assert "| 3.00 |" not in again and "output differs" not in again


def test_render_of_several_runs_names_each_runs_rows_and_tables_per_task(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(DOC_TEXT)
    tasks = {"writing": dict(prompts=1, tau=2.1, speedup=0.5), "math": dict(prompts=1, tau=1.9, speedup=None)}
    first = write_run(tmp_path / "a.json", [plain(), clover2(per_task=tasks)])
    second = write_run(tmp_path / "b.json", [plain(temperature=1.0), clover2(temperature=1.0)])
    assert results.main(["render", "one", str(first), str(second), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| 1 | plain | 1 |" in text and "| 2 | plain T=1 | 1 |" in text and "| 2 | clover2 T=1 | 1 |" in text
    assert "| run | speedup (tau) per task | writing | math |" in text
    assert "| 1 | clover2 chain:5, batch 1 | 0.50x (2.10) | - (1.90) |" in text
    assert "Run 1: measured" in text and "Run 2: measured" in text
    assert results.main(["render", "--no-tasks", "one", str(first), "--doc", str(doc)]) == 0
    assert "per task" not in doc.read_text()


def test_steps_puts_two_runs_side_by_side_and_says_when_the_after_run_is_to_come(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(DOC_TEXT)
    before = write_run(tmp_path / "before.json", [plain(), clover2(), plain(batch=8, step_ms=10.0)])
    after = tmp_path / "after.json"
    assert results.main(["steps", "one", str(before), str(after), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| method | tree (nodes) | batch | step ms before |" in text and "| clover2 | chain:5 (6) | 1 | 3.00 |" in text
    assert f"The after run (`{after.as_posix()}`, the same command) is to come." in text
    write_run(after, [plain(step_ms=2.2), clover2(step_ms=2.7)])
    assert results.main(["steps", "one", str(before), str(after), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| plain | - | 1 | 2.00 | 2.20 | 1.10 |" in text and "| clover2 | chain:5 (6) | 1 | 3.00 | 2.70 | 0.90 |" in text
    assert "| plain | - | 8 | 10.00 | - | - |" in text  # a row the after run did not measure
    assert "is to come" not in text and "Before: measured" in text and "After: measured" in text


def test_a_document_without_the_sections_markers_or_a_file_that_is_no_benchmark_json_is_one_error_line(tmp_path, capsys):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n")
    run = write_run(tmp_path / "run.json", [plain()])
    assert results.main(["render", "one", str(run), "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "<!-- results:one -->" in err and doc.read_text() == "# Results\n"
    (tmp_path / "bad.json").write_text('{"rows": []}')
    assert results.main(["render", "one", str(tmp_path / "bad.json"), "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a benchmark JSON" in err


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_section_of_a_results_page_is_what_its_command_makes_from_its_json(page, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the commands name their JSONs from the repository root
    name = page.relative_to(REPO).as_posix()
    commands = [shlex.split(line)[3:] for line in page.read_text().splitlines()
                if line.startswith("python -m infer.results ")]
    sections = page.read_text().count("<!-- /results:")
    assert len(commands) == sections >= 1, "a render command above every marked section"
    # a command writes the page it is written on: docs/results.md by default, a history page by --doc
    assert all((argv[argv.index("--doc") + 1] if "--doc" in argv else results.DOC) == name for argv in commands)
    copy = tmp_path / "results.md"
    copy.write_text(page.read_text())
    for argv in commands:
        assert results.main([*argv, "--doc", str(copy)]) == 0, argv
    assert copy.read_text() == page.read_text(), f"{name} is stale: run the render commands written in it"
    json_files = {a for argv in commands for a in argv if a.endswith(".json")}
    assert all((REPO / f).is_file() for f in json_files)


def test_docs_results_holds_todays_figures_one_table_per_question():
    assert len(PAGES) > 1  # the moved sections were found in docs/history/
    assert len(DOC.read_text().splitlines()) <= 300, \
        "docs/results.md holds one table per question: move older sections to docs/history/ as they are"
