"""Faults a demanding user runs into, each reproduced: a seed too large, a damaged input, Ctrl-C wherever
it lands, a closed pipe, NaN training, counts that mean nothing, a resume that cannot continue, a path
that passes a permission check but cannot be written, a full disk. Each ends in one clear line (no
traceback) and uses nothing stale; what was there before stays whole.
"""

import errno
import gc
import json
import pathlib
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from clover_jax import _cli as cli
from clover_jax.engine.decode import Generator
from clover_jax.errors import CloverError
from infer import benchmark, generate
from train import evaluate, losses, make_data, runs, train
from test_train import _argv, _train

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = REPO / "models" / "reference"
UNWRITABLE = pathlib.Path("/proc/clover-jax-test")  # os.access says yes to root under /proc; writing fails


def one_error_line(err: str) -> str:
    """The one `error:` line a refused run printed (no traceback, nothing else but a progress bar's last
    state when it stopped mid-run)."""
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # tqdm redraws with \r
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def parse_error(capsys, main, argv) -> str:
    """What argparse says of a flag value its type refuses: exit 2, its usage and one error line."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------
# 6. Seeds: the range a JAX key tells apart, checked up front for the whole run.

@pytest.mark.parametrize("main, argv", [
    (generate.main, ["--prompt", "x"]),
    (make_data.main, ["--base", "x", "--prompts", "x", "--out", "x"]),
    (train.main, ["--method", "clover", "--base", "x", "--data", "x", "--out", "x"]),
    (benchmark.main, []),
])
@pytest.mark.parametrize("seed", ["123456789012345678901234567890", "-1", str(2 ** 32)])
def test_a_seed_out_of_range_is_refused_as_it_is_parsed(main, argv, seed, capsys):
    line = parse_error(capsys, main, argv + ["--seed", seed])
    assert f"argument --seed: {seed} is outside 0..4294967295" in line, line


def test_a_seed_the_later_batches_would_pass_is_refused_before_any_output(tmp_path, capsys):
    """--seed S with N batches takes S..S+N-1: refused before the first batch prints, not at the second."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n{"prompt": "import os"}\n')
    argv = ["--model", REFERENCE, "--prompts", prompts, "--batch-size", 1, "--max-new-tokens", 2]
    assert generate.main([str(a) for a in argv + ["--seed", 2 ** 32 - 2]]) == 0  # seeds 2**32-2 and 2**32-1
    capsys.readouterr()
    assert generate.main([str(a) for a in argv + ["--seed", 2 ** 32 - 1]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "give --seed at most 4294967294" in one_error_line(err)


def test_the_library_refuses_a_seed_a_key_cannot_hold(loaded):
    gen = Generator(loaded("llama2")[3])
    for seed in (-1, 2 ** 32, 2 ** 64):
        with pytest.raises(CloverError, match=r"must be in \[0, 2\*\*32\)"):
            gen.generate([[1, 2]], 2, seed=seed)


# ---------------------------------------------------------------------------------------------------
# 8., 12., 15. Counts that mean nothing are refused, not read as the default.

def test_make_data_chunk_zero_is_one_line(tmp_path, capsys):
    argv = ["--base", REFERENCE, "--prompts", REFERENCE / "prompts.jsonl", "--out", tmp_path / "d",
            "--answers", tmp_path / "answers", "--chunk", 0]
    assert make_data.main([str(a) for a in argv]) == 2
    assert "--chunk 0 must be >= 1" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "d").exists() and not (tmp_path / "answers").exists()


@pytest.mark.parametrize("main, argv", [
    (generate.main, ["--prompt", "x", "--method", "medusa", "--heads", "random"]),
    (train.main, ["--method", "clover", "--base", "x", "--data", "x", "--out", "x"]),
])
def test_zero_heads_is_refused(main, argv, capsys):
    assert "argument --num-heads: 0 must be >= 1" in parse_error(capsys, main, argv + ["--num-heads", 0])


# ---------------------------------------------------------------------------------------------------
# 9. Ctrl-C always stops the run; 10. a closed pipe ends it quietly.

def test_ctrl_c_in_a_gc_callback_still_stops_the_run(capsys, ctrl_c, monkeypatch):
    """A KeyboardInterrupt raised in a gc callback (JAX's runs over every compiled program) would be
    printed as "Exception ignored" and the run would go on: the handler delivers it again just after."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    finished = []

    def body():
        fired = []

        def callback(phase, info):
            if phase == "start" and not fired:
                fired.append(1)
                signal.raise_signal(signal.SIGINT)
                sum(range(1000))  # bytecodes in this frame, where the handler runs

        gc.callbacks.append(callback)
        try:
            gc.collect()
            deadline = time.time() + 5
            while time.time() < deadline:
                time.sleep(0.01)
        finally:
            gc.callbacks.remove(callback)
        finished.append(1)
        return 0

    assert cli.run_main(body) == cli.INTERRUPTED
    assert not finished and not unraisable
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_ctrl_c_something_caught_still_ends_with_130(capsys, ctrl_c):
    def body():
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return 0

    assert cli.run_main(body) == cli.INTERRUPTED
    assert capsys.readouterr().err.strip() == "interrupted"


# A tool run as `python -m`, with SIGINT raising KeyboardInterrupt as in a terminal (a shell that started
# the tests in the background may have left it ignored, and a preexec_fn would fork a threaded process).
RUN_TOOL = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def _tool(*argv, **popen):
    return subprocess.Popen([sys.executable, "-c", RUN_TOOL, *map(str, argv)], cwd=REPO, stderr=subprocess.PIPE,
                            text=True, **popen)


@pytest.mark.slow
def test_ctrl_c_during_generate_is_130_with_whole_lines_every_time():
    for delay in (0.0, 0.03, 0.3):
        proc = _tool("infer.generate", "--model", REFERENCE, "--prompts", REFERENCE / "prompts.jsonl", "--json",
                     "--batch-size", 1, "--max-new-tokens", 16, stdout=subprocess.PIPE)
        first = proc.stdout.readline()  # the first answer is out: the loop runs
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
        assert proc.returncode == cli.INTERRUPTED, (delay, proc.returncode, err)
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert err.rstrip().splitlines()[-1] == "interrupted", err
        lines = (first + rest).splitlines()
        assert lines and all(json.loads(line)["text"] is not None for line in lines)


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly_with_141():
    """`| head -c 10`: the reader goes; the tool ends with 141 (as a Unix tool killed by SIGPIPE), silent."""
    proc = _tool("infer.generate", "--model", REFERENCE, "--prompts", REFERENCE / "prompts.jsonl",
                 "--batch-size", 1, "--max-new-tokens", 4, stdout=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.CLOSED_PIPE and err == "", err


def test_run_main_turns_a_broken_pipe_into_141(capsys):
    def body():
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    assert cli.run_main(body) == cli.CLOSED_PIPE
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------
# 11. A NaN prediction is never right.

def test_nan_logits_score_as_misses():
    """NaN compares false with everything: unguarded, every target ranked 0 and NaN heads scored tau 4."""
    logits = jnp.full((2, 1, 4, 8), jnp.nan)  # [K, B, T, V]
    targets, masks = jnp.ones((2, 1, 4), jnp.int32), jnp.ones((2, 1, 4))
    assert np.all(np.asarray(losses.target_ranks(logits, targets, masks)) == losses.RANK_CAP)
    assert np.all(np.asarray(losses.topk_accuracy(logits, targets, masks, 5)) == 0)
    one_nan = jnp.zeros((2, 1, 4, 8)).at[..., 3].set(jnp.nan)  # the target's logit finite, another NaN
    assert np.all(np.asarray(losses.target_ranks(one_nan, targets, masks)) == losses.RANK_CAP)
    finite = jnp.zeros((2, 1, 4, 8)).at[..., 1].set(1.0)
    assert np.all(np.asarray(losses.target_ranks(finite, targets, masks)) == 0)
    assert np.all(np.asarray(losses.topk_accuracy(finite, targets, masks, 1)) == 1)


# ---------------------------------------------------------------------------------------------------
# 11.-14. and 16. Training refuses what would export nothing honest.

@pytest.fixture(scope="module")
def finished(model_dir, datasets, tmp_path_factory):
    """(out, work) of a finished 6-step Clover run with seed 3."""
    root = tmp_path_factory.mktemp("finished")
    assert train.main(_argv(model_dir, datasets["plain"], root / "out", root / "work", "clover")) == 0
    return root / "out", root / "work"


def test_nan_training_stops_in_one_line_and_exports_nothing(model_dir, datasets, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    code, stdout, err = _train(capsys, model_dir, datasets["plain"], out, work, "clover", "--lr", "nan")
    assert (code, stdout) == (2, "")
    assert one_error_line(err).startswith("error: step 6: the training loss is nan; nothing saved or exported")
    assert not out.exists() and not list((work / "checkpoints").glob("[0-9]*"))


def test_too_short_a_window_is_refused(model_dir, datasets, tmp_path, capsys):
    """Head k learns the token k + 2 ahead: 2 heads need windows of 4 tokens; --seq-len 1 trained nothing."""
    code, _, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "out", tmp_path / "work", "clover",
                          "--seq-len", 3)
    assert code == 2 and "--seq-len 3: a window of 2 heads' targets needs at least 4 tokens" in one_error_line(err)
    assert not (tmp_path / "out").exists()


def test_a_resume_that_cannot_continue_the_run_is_refused(finished, model_dir, datasets, tmp_path, capsys):
    out, work = finished
    heads = (out / "heads.json").read_bytes()
    code, _, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "o", work, "clover", "--resume",
                          "--seed", 4)
    assert code == 2 and "was started with seed=3, not 4" in one_error_line(err)
    code, _, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "o", work, "clover", "--resume",
                          "--steps", 3)
    assert code == 2 and "--steps 3: " in one_error_line(err) and "holds step 6 already" in err
    assert not (tmp_path / "o").exists() and (out / "heads.json").read_bytes() == heads


def test_evaluate_refuses_a_fit_of_no_tree(finished, model_dir, datasets, capsys):
    argv = ["--heads", finished[0], "--base", model_dir, "--data", datasets["plain"], "--fit-tree", 0]
    capsys.readouterr()
    assert evaluate.main([str(a) for a in argv]) == 2
    assert "--fit-tree 0 must be >= 2" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("tool", ["train --out", "train --work-dir", "make_data --out", "evaluate --json",
                                  "evaluate --tree-out", "benchmark --json", "benchmark --plot"])
def test_a_path_that_cannot_be_written_is_refused_before_any_work(tool, finished, model_dir, datasets, tmp_path,
                                                                   capsys, monkeypatch):
    """Probed by writing, not by os.access (which says yes to root under /proc), before the base model
    loads, so nothing is trained or timed first; the message names the path given, not a `.tmp` file."""
    name, flag = tool.split()
    for module in (train, evaluate, make_data, benchmark):
        monkeypatch.setattr(module, "load_pretrained", lambda *a, **k: pytest.fail("loaded before the check"))
    bad = UNWRITABLE.with_suffix(".png" if flag == "--plot" else ".json" if flag in ("--json", "--tree-out") else "")
    if name == "train":
        out, work = (bad, tmp_path / "w") if flag == "--out" else (tmp_path / "o", bad)
        code = train.main(_argv(model_dir, datasets["plain"], out, work, "clover"))
    elif name == "make_data":
        code = make_data.main([str(a) for a in ["--base", model_dir, "--prompts", REFERENCE / "prompts.jsonl",
                                                "--out", bad]])
    elif name == "evaluate":
        extra = ["--fit-tree", 4] if flag == "--tree-out" else []
        code = evaluate.main([str(a) for a in ["--heads", finished[0], "--base", model_dir, "--data",
                                               datasets["plain"], flag, bad, *extra]])
    else:
        code = benchmark.main([str(a) for a in ["--model", REFERENCE, flag, bad]])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} {bad}: cannot write into " in one_error_line(err) and ".tmp" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_a_work_dir_without_room_for_its_checkpoints_is_refused(model_dir, datasets, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setattr(runs, "disk_usage", lambda path: type("usage", (), {"free": 1000})())
    code, _, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "out", tmp_path / "work", "clover")
    assert code == 2 and "no space left on " in one_error_line(err) and "checkpoints need about" in err


def test_a_full_disk_under_orbax_is_one_line(model_dir, datasets, tmp_path, capsys, monkeypatch):
    """The work dir fills mid-run: orbax's RESOURCE_EXHAUSTED is one line naming --work-dir, and the
    checkpoint before it stays whole (here a save that raises as orbax does, after the first)."""
    saves = []
    real = runs.ocp.CheckpointManager.save

    def save(self, step, *a, **k):
        saves.append(step)
        if step > 2:
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database: Failed to write 1799893 '
                             "bytes to file 4: No space left on device [os_error_code='28']")
        return real(self, step, *a, **k)

    monkeypatch.setattr(train.ocp.CheckpointManager, "save", save)
    work = tmp_path / "work"
    code, _, err = _train(capsys, model_dir, datasets["plain"], tmp_path / "out", work, "clover", "--ckpt-every", 2)
    assert code == 2 and f"no space left on {work} (--work-dir) for a checkpoint at step 4" in one_error_line(err)
    assert sorted(int(p.name) for p in (work / "checkpoints").glob("[0-9]*")) == [2]


@pytest.mark.parametrize("error, needle", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/heads/heads.safetensors.tmp"),
     "no space left on /data/heads (writing /data/heads/heads.safetensors)"),
    (OSError(errno.EACCES, "Permission denied", "/data/out.json.tmp"), "Permission denied: '/data/out.json'"),
])
def test_an_os_error_names_the_file_asked_for(error, needle, capsys):
    def body():
        raise error

    assert cli.run_main(body) == 2
    assert needle in one_error_line(capsys.readouterr().err)

@pytest.mark.parametrize("message, arguments, printed", [
    ("x; lower max_new_tokens= or raise max_len=", ("max_new_tokens", "max_len"),
     "x; lower --max-new-tokens or raise --max-len"),
    ("draft_vocab='many': give auto; or pass draft_vocab=0", ("draft_vocab",),
     "--draft-vocab 'many': give auto; or pass --draft-vocab 0"),
    ("system= is a turn of the chat template; add chat=True", ("system", "chat"),
     "--system is a turn of the chat template; add --chat"),
    ("streaming (on_tokens=) runs in one process", ("on_tokens",), "streaming (--stream) runs in one process"),
    ("mesh='data=2,model=x': not an integer", ("mesh",), "--mesh 'data=2,model=x': not an integer"),
    ("max_len=4 stays", (), "max_len=4 stays"),
])
def test_a_library_error_names_arguments_and_a_tool_prints_its_flags(message, arguments, printed, capsys):
    """The library speaks of the arguments a Python caller passed; run_main prints those the error lists
    as the flags a tool's user typed, and leaves every other `name=` in the line as it is."""
    def body():
        raise CloverError(message, arguments=arguments)

    assert cli.run_main(body) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {printed}"



def test_ctrl_c_asks_once_interrupts_twice_and_an_ignored_sigint_stays_ignored(capsys, ctrl_c):
    """runs.stop_on_interrupt: the first SIGINT only asks the loop to stop, a second one interrupts, the
    handler before is put back; where SIGINT is ignored (nohup, a background job) it stays ignored."""
    before = signal.getsignal(signal.SIGINT)
    with runs.stop_on_interrupt() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set() and "stopping after this step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with runs.stop_on_interrupt() as stop:
            signal.raise_signal(signal.SIGINT)
            assert not stop.is_set()
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_checkpoint_of_other_parameters_is_refused_in_one_line(tmp_path):
    """A work directory checkpointed by another version (here q, k and v apart, where the run has them
    fused) is refused on resume with one line, not a page of orbax's tree diff."""
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    manager.save(3, args=ocp.args.StandardSave({"params": {"q_proj": jnp.zeros(4), "k_proj": jnp.zeros(2)}}))
    manager.wait_until_finished()
    with pytest.raises(CloverError, match=r"step 3 does not fit this run's parameters .* new work directory") as e:
        runs.restore_latest(manager, {"params": {"qkv_proj": jnp.zeros(6)}})
    assert "\n" not in str(e.value)
