"""Run by tests/test_sharding.py in a fresh process with 8 virtual CPU devices: the same Clover-2 head
training on one device, on a data=4,model=2 mesh, and stopped on that mesh then resumed on
data=2,fsdp=2,model=2; then the same training data (fixed and self-distilled, with hidden states)
made on one device and on a data=4,model=2 mesh. Args: model_dir data_dir out_root prompts_file."""

import sys

import jax

from train import make_data, train

model_dir, data, root, prompts = sys.argv[1:5]
assert jax.device_count() == 8
common = ["--method", "clover2", "--base", model_dir, "--data", data, "--steps", "6", "--batch-size", "4",
          "--seq-len", "32", "--dtype", "float32", "--warmup", "1", "--lr", "1e-2", "--num-heads", "2",
          "--seed", "3", "--val-fraction", "0", "--ckpt-every", "1"]
runs = {"one": [], "sharded": ["--mesh", "data=4,model=2"]}
for name, extra in runs.items():
    assert train.main(common + ["--out", f"{root}/{name}", "--work-dir", f"{root}/w-{name}"] + extra) == 0
resumed = common + ["--out", f"{root}/resumed", "--work-dir", f"{root}/w-resumed"]
assert train.main(resumed + ["--mesh", "data=4,model=2", "--stop-after", "3"]) == 0
assert train.main(resumed + ["--mesh", "data=2,fsdp=2,model=2", "--resume"]) == 0
for name, extra in {"one": [], "sharded": ["--mesh", "data=4,model=2"]}.items():
    for mode in ("fixed", "self"):
        assert make_data.main([f"--base={model_dir}", f"--prompts={prompts}", f"--out={root}/data-{mode}-{name}",
                               f"--mode={mode}", "--batch-size=4", "--max-new-tokens=8",
                               "--store-hidden=float16"] + extra) == 0
print("done")
