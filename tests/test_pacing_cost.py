"""`python -m infer.pacing_cost`: its account of a paced loop's steps, and one run on the shipped
reference model (figures are measured, not checked: only their bookkeeping is)."""

import json

import pytest

from infer import pacing_cost


@pytest.mark.parametrize("plain, expected", [(0, 0), (1, 1), (8, 1), (9, 2), (24, 3), (120, 15), (121, 16),
                                             (184, 23)])
def test_flushes_follow_the_probe_schedule(plain, expected):
    # Runs of 8, 16, 32, 64, 64, ... plain steps, each flushed every 8 steps and at its end.
    assert pacing_cost.flushes(plain) == expected


def test_a_run_accounts_for_every_step(tmp_path, capsys):
    out = tmp_path / "pacing.json"
    assert pacing_cost.main(["--methods", "medusa", "--num-prompts", "1", "--max-new-tokens", "40", "--repeats", "1",
                             "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    [row] = record["rows"]
    assert row["method"] == "medusa" and row["tree"] == "chain:3"
    # Never paying, the loop probes once before each run of plain steps (and maybe once at its end).
    runs, left, wait = 0, row["plain_steps"], 8
    while left > 0:
        runs, left, wait = runs + 1, left - wait, min(2 * wait, 64)
    assert row["probes"] in (runs, runs + 1)
    assert row["plain_steps"] + row["probes"] <= 40
    assert row["flush_ms"] > 0 and row["plain_step_ms"] > 0
    split = row["paced_plain_step_ms"] - row["plain_step_ms"] - row["flush_per_plain_step_ms"]
    assert row["loop_overhead_ms"] == pytest.approx(split)
    printed = capsys.readouterr().out
    assert "| medusa | chain:3 |" in printed


@pytest.mark.parametrize("argv, message", [(["--repeats", "0"], "--repeats 0 must be >= 1"),
                                           (["--methods", " , "], "--methods names no method")])
def test_bad_flags_are_one_line(argv, message, capsys):
    assert pacing_cost.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
