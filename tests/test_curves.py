"""train.curves: the held-out table and plot of head training runs, from their work directories."""

from __future__ import annotations

import json

import pytest

from train import curves


def _work(path, method, records):
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"method": method}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _held(step, time, tau, loss, top1, by_depth=None):
    record = {"step": step, "time": time, "val_loss": loss, "val_top1": top1, "val_chain_tau": tau}
    return record | ({"val_chain_tau_by_depth": by_depth} if by_depth else {})  # runs before it: none


@pytest.fixture
def runs(tmp_path):
    # A run killed after step 20 (its step-20 evaluation then redone on resume, an hour later) and one
    # evaluated at other steps.
    a = _work(tmp_path / "a", "clover2", [
        {"step": 10, "time": 0.0, "loss": 9.0}, _held(10, 5.0, 1.1, 8.0, [0.1, 0.2]),
        {"step": 20, "time": 65.0, "loss": 7.0}, _held(20, 70.0, 1.15, 7.5, [0.1, 0.2]),
        {"step": 20, "time": 3670.0, "loss": 7.0}, _held(20, 3690.0, 1.2, 7.0, [0.3, 0.25], [1.15, 1.2]),
    ])
    b = _work(tmp_path / "b", "medusa", [{"step": 30, "time": 0.0, "loss": 5.0}, _held(30, 120.0, 1.3, 6.0, [0.4])])
    return a, b


def test_table_keeps_a_resumed_steps_latest_evaluation_and_leaves_stops_out_of_the_time(runs, capsys):
    assert curves.main([str(p) for p in runs]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("| run | method | minutes | chain tau @ 10 | chain tau @ 20 | chain tau @ 30 | held-out loss "
                        "| top-1 per head (last) | chain tau by depth (last) |")
    assert lines[2] == "| a | clover2 | 1.5 | 1.100 | 1.200 |  | 8.00 -> 7.00 | 0.300, 0.250 | 1.150, 1.200 |"  # 90 s: the 3,600 idle left out
    assert lines[3] == "| b | medusa | 2.0 |  |  | 1.300 | 6.00 -> 6.00 | 0.400 |  |"


def test_plot_and_table_files_are_written(runs, tmp_path, capsys):
    out, png = tmp_path / "t.md", tmp_path / "c.png"
    assert curves.main([*map(str, runs), "--plot", str(png), "--out", str(out)]) == 0
    assert capsys.readouterr().out == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.read_text().count("\n") == 4


@pytest.mark.parametrize("case", ["missing", "no-eval", "bad-json", "bad-plot"])
def test_bad_input_is_one_error_line_and_exit_2(case, runs, tmp_path, capsys):
    args = [str(runs[0])]
    if case == "missing":
        args = [str(tmp_path / "nowhere")]
    elif case == "no-eval":
        args = [str(_work(tmp_path / "c", "clover", [{"step": 10, "time": 0.0, "loss": 9.0}]))]
    elif case == "bad-json":
        (runs[0] / "metrics.jsonl").write_text("{not json\n")
    else:
        args += ["--plot", str(tmp_path / "c.xyz")]
    assert curves.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert {"missing": "no run.json", "no-eval": "no held-out evaluation", "bad-json": "cannot read",
            "bad-plot": "cannot write a .xyz image"}[case] in err, err
