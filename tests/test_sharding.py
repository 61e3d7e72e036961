"""Sharding: the mesh spec and rule table; sharded generation giving the single-device tokens and sharded
head training the single-device heads, on 8 virtual CPU devices (a fresh process: the device count is
fixed when JAX starts)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file

from clover_jax.errors import CloverError
from clover_jax.model.sharding import make_mesh, parse_mesh, spec_for
from conftest import HEAD_RECORDS, assert_one_line
from train.data import HeadDataset

HERE = Path(__file__).resolve().parent
# Draft vocabularies, streaming and EAGLE-3 run on the meshes that split both the batch and the model;
# the others check plain and speculative generation and a single prompt.
EVERYTHING = ("data=2,model=4", "fsdp=2,model=4")
MESHES = EVERYTHING + ("data=8,model=1", "model=4")


@pytest.fixture(scope="module")
def sharded_results():
    # The checkout's own code, not whichever one an editable install points at.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    meshes = [f"{m}:all" if m in EVERYTHING else m for m in MESHES]
    proc = subprocess.run([sys.executable, str(HERE / "sharded_run.py"), *meshes],
                          capture_output=True, text=True, env=env, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.slow
def test_sharded_generation_matches_one_device(sharded_results, mesh):
    """model=4 runs on 4 of the 8 devices; a single prompt is filled to the batch split and comes back alone."""
    one, sharded = sharded_results["None"], sharded_results[mesh]
    assert sharded["plain"] == one["plain"]
    assert sharded["one_prompt"] == one["plain"][1:2]
    used = 4 if mesh == "model=4" else 8
    assert sharded["mesh"] == f"{mesh.replace(',model=1', '')} on {used} of 8 devices"
    assert sharded["speculative"] == one["speculative"] == one["plain"]
    if mesh in EVERYTHING:
        assert sharded["draft_vocab"] == one["draft_vocab"] == one["plain"]
        assert sharded["streamed"] == one["streamed"] == one["plain"]  # the last step's tokens, handed to the host
        assert sharded["eagle3"] == one["eagle3"] == one["plain"]  # a draft model with its own cache
        assert sharded["long_prompt"] == one["long_prompt"]  # its prefill in query blocks


@pytest.mark.slow
def test_params_and_caches_really_are_sharded(sharded_results):
    r = sharded_results["data=2,model=4"]
    assert r["gate_proj"] == str(PartitionSpec(None, "model")) and r["gate_proj_shards"] == 4
    assert r["cache"] == str(PartitionSpec("data", "model")) == r["aug_cache"]
    assert r["draft_vocab_rows"] == str(PartitionSpec("model", None))  # split over the vocabulary, as lm_head is
    assert r["eagle3_cache"] == r["cache"] and r["eagle3_lm_head"] == str(PartitionSpec(None, "model"))
    assert sharded_results["fsdp=2,model=4"]["gate_proj"] == str(PartitionSpec("fsdp", "model"))
    assert sharded_results["data=8,model=1"]["cache"] == str(PartitionSpec("data"))


def test_mesh_spec_parsing_and_errors():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh(None) == {"data": jax.device_count()}
    for bad, msg in [("data:2", "axis=size"), ("tensor=2", "axis=size"), ("data=two", "not an integer"),
                     ("data=0", "size >= 1"), ("data=1,data=1", "each axis once")]:
        with pytest.raises(CloverError, match=msg) as e:
            parse_mesh(bad)
        assert_one_line(e)
    with pytest.raises(CloverError, match="needs 8 devices") as e:
        make_mesh("data=2,model=4")
    assert_one_line(e)
    assert parse_mesh("data=-1,model=2") == {"data": -1, "model": 2}
    with pytest.raises(CloverError, match="only one axis can be -1") as e:
        parse_mesh("data=-1,model=-1")
    assert_one_line(e)
    with pytest.raises(CloverError, match=r"the other axes \(2 devices\) do not divide the 1 devices") as e:
        make_mesh("data=-1,model=2")
    assert_one_line(e)
    assert dict(make_mesh("model=-1").shape) == {"data": 1, "fsdp": 1, "model": 1}


@pytest.mark.slow
def test_a_mesh_may_take_fewer_devices_or_the_rest(sharded_results):
    """On 8 devices: -1 takes what the other axes leave; sizes multiplying to fewer take the first ones."""
    shapes = sharded_results["shapes"]
    assert shapes["data=-1,model=4"] == ["data=2,model=4 on 8 of 8 devices", {"data": 2, "fsdp": 1, "model": 4}]
    assert shapes["model=-1"][1] == {"data": 1, "fsdp": 1, "model": 8}
    assert shapes["fsdp=2,data=-1"][0] == "data=4,fsdp=2 on 8 of 8 devices"


def test_a_mesh_that_does_not_divide_the_model_is_one_clear_line():
    """3 kv heads over model=2: the rule table refuses with the axis and sizes named."""
    mesh = make_mesh("data=1", jax.devices()[:1])
    assert spec_for(("embed", "kv_heads"), (32, 24), mesh) == PartitionSpec(None, None)

    class Fake:  # a 2-wide model axis, without needing two devices
        shape = {"data": 1, "fsdp": 1, "model": 2}

    with pytest.raises(CloverError, match=r"kv_heads axis \(3\) does not divide over mesh axes model=2") as e:
        spec_for(("embed", "kv_heads"), (32, 3), Fake(), "layers.0.self_attn.qkv_proj.kernel")
    assert_one_line(e)
    assert spec_for(("embed", "kv_heads"), (32, 4), Fake()) == PartitionSpec(None, "model")


@pytest.mark.slow
def test_two_processes_generate_the_single_process_tokens(sharded_results):
    """jax.distributed on localhost: two processes of 2 CPU devices each, one data=2,model=2 mesh."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_run.py"), str(i), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE.parent)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    one = sharded_results["None"]
    for out, _ in outs:
        r = json.loads(out.strip().splitlines()[-1])
        assert r["plain"] == one["plain"] and r["speculative"] == one["speculative"]


@pytest.mark.slow
def test_generate_one_prompt_on_a_data_axis_and_the_rest_of_the_devices(capsys):
    """`infer.generate --mesh data=2,model=-1 --prompt ...` on 8 devices: the single prompt is filled to the
    data axis, -1 takes the 4 devices left, the statistics line says so, and the text is one device's."""
    from infer import generate

    flags = ["--prompt", "def fibonacci(n):", "--max-new-tokens", "6", "--compile-cache", "off"]
    assert generate.main(flags) == 0
    want = capsys.readouterr().out
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "infer.generate", "--mesh", "data=2,model=-1", *flags],
                          capture_output=True, text=True, env=env, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want
    assert "mesh data=2,model=4 on 8 of 8 devices" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_sharded_training_matches_and_resumes_on_another_mesh(model_dir, datasets, tmp_path):
    """8 virtual CPU devices, in a fresh process (the device count is fixed when JAX starts): Clover-2
    heads trained on a data=4,model=2 mesh equal the one-device run, and so does a run stopped on that
    mesh and resumed from its orbax checkpoint on data=2,fsdp=2,model=2. `make_data --mesh` writes the
    same data (tokens; hidden states to float16 rounding), fixed and self-distilled."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))  # this checkout's package
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in HEAD_RECORDS))
    proc = subprocess.run([sys.executable, str(HERE / "sharded_train_run.py"), str(model_dir),
                           str(datasets["hidden"]), str(tmp_path), str(prompts)], capture_output=True, text=True,
                          env=env, timeout=900, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    heads = {name: load_file(tmp_path / name / "heads.safetensors") for name in ("one", "sharded", "resumed")}
    assert heads["one"].keys() == heads["sharded"].keys() == heads["resumed"].keys()
    for name in ("sharded", "resumed"):
        for key, value in heads["one"].items():
            np.testing.assert_allclose(heads[name][key], value, atol=2e-5, rtol=1e-4, err_msg=f"{name}: {key}")
    for mode in ("fixed", "self"):
        one, sharded = (HeadDataset(tmp_path / f"data-{mode}-{name}") for name in ("one", "sharded"))
        np.testing.assert_array_equal(sharded.tokens, one.tokens)
        np.testing.assert_array_equal(sharded.loss_mask, one.loss_mask)
        np.testing.assert_allclose(sharded.hidden.astype(np.float32), one.hidden.astype(np.float32), atol=2e-3, rtol=2e-3)
