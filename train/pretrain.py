"""Train the reference base model from scratch on the CPython standard library.

    python -m train.pretrain --out models/reference --work-dir runs/pretrain

Uses the project's own `Llama` and optax (AdamW, warmup + cosine, global-norm clipping). Batches are
a pure function of (seed, step), and orbax saves parameters, optimizer state and the step together,
so a killed run resumes exactly where it stopped (`--work-dir` is reused automatically). The result
is exported as a Hugging Face checkpoint (bfloat16 safetensors + tokenizer), the same format and
import path as a downloaded Vicuna or Llama-3.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from clover_jax import Llama, ModelConfig
from clover_jax.io.files import copy_file, write_text
from clover_jax.training import causal_self_mask, save_pretrained
from clover_jax import _cli as cli
from train import corpus
from train.runs import MetricsLog, pin_run, restore_latest, stop_due, stop_on_interrupt
from train.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer


def model_config(args, vocab_size: int, eos_id: int, bos_id: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, rope_theta=10000.0, max_position_embeddings=args.seq_len,
        tie_word_embeddings=True, bos_token_id=bos_id, eos_token_ids=(eos_id,), rms_norm_eps=1e-5)


def batch_at(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """Windows [B, T+1] of the token stream for `step`: a pure function of (seed, step), so resume
    needs nothing but the step number."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """Fixed, evenly spaced held-out windows [count, T+1]: the same every evaluation and every run."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    return np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int32)


def loss_fn(model: Llama, windows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over windows [B, T+1]."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits = model(inputs, positions, causal_self_mask(b, t), causal=True).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(args) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m train.pretrain",
        description="Train the reference Llama from scratch on the CPython standard library and export "
                    "it as a Hugging Face checkpoint. Rerunning with the same --work-dir resumes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="models/reference", help="where the final HF checkpoint is written")
    p.add_argument("--work-dir", default="runs/pretrain",
                   help="orbax checkpoints, metrics.jsonl and the tokenizer cache; reused to resume")
    p.add_argument("--data-dir", default="data", help="cache of the tokenized corpus (.npy)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int, default=256, help="model width D")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--intermediate", type=int, default=704, help="SwiGLU hidden size")
    p.add_argument("--seq-len", type=int, default=512, help="training context; also max_position_embeddings")
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--steps", type=int, default=350, help="optimizer steps in all (the cosine schedule length)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch-order seed")
    p.add_argument("--eval-every", type=int, default=50, help="held-out evaluation period (steps)")
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows per evaluation")
    p.add_argument("--ckpt-every", type=int, default=25, help="checkpoint period (steps)")
    p.add_argument("--stop-after", type=int, default=0, metavar="STEP",
                   help="stop cleanly (checkpoint, no export) once this step is done, as a kill would; "
                        "0 = run to --steps")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="stop cleanly (checkpoint, no export) after this many minutes; 0 = no limit")
    p.add_argument("--export-only", action="store_true",
                   help="skip training: export the latest checkpoint in --work-dir to --out")
    args = p.parse_args(argv)
    return cli.run_main(lambda: run(args))


def run(args) -> int:
    cli.check_output_dir(args.out, "--out")  # written only at the export: a bad path must not wait for the training
    work = Path(args.work_dir).resolve()
    cli.check_output_dir(work, "--work-dir")
    work.mkdir(parents=True, exist_ok=True)
    tok_dir = work / "tokenizer"
    files = corpus.split_files(corpus.list_files())
    if not (tok_dir / "tokenizer.json").is_file():
        tok = train_tokenizer((corpus.read_text(f) for f in files["train"]), args.vocab_size)
        save_tokenizer(tok, tok_dir)
        corpus.write_split(tok_dir)
    tok = corpus.load_tokenizer(tok_dir)
    eos_id = tok.token_to_id(EOS_TOKEN)
    bos_id = tok.token_to_id("<|bos|>")
    cfg = model_config(args, tok.get_vocab_size(), eos_id, bos_id)
    train_tokens = corpus.load_or_encode(args.data_dir, tok_dir / "tokenizer.json", "train")
    val_tokens = corpus.load_or_encode(args.data_dir, tok_dir / "tokenizer.json", "validation")
    val_bytes = sum(len(corpus.read_text(f).encode("utf-8")) for f in files["validation"])
    tokens_per_byte = (len(val_tokens) - len(files["validation"])) / val_bytes  # EOS markers carry no bytes

    model = Llama(cfg, rngs=nnx.Rngs(args.seed))
    optimizer = make_optimizer(args)
    graphdef, params = nnx.split(model)
    opt_state = optimizer.init(params)
    manager = ocp.CheckpointManager(work / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    pin_run(work, {"vocab_size": cfg.vocab_size, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                   "kv_heads": args.kv_heads, "intermediate": args.intermediate, "seq_len": args.seq_len})
    start, restored = restore_latest(manager, {"params": params, "opt_state": opt_state})
    params, opt_state = restored["params"], restored["opt_state"]
    if start:
        print(f"resumed from step {start} in {work}", file=sys.stderr)

    @jax.jit
    def evaluate(params, windows):
        return loss_fn(nnx.merge(graphdef, params), windows)

    @jax.jit
    def train_step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), windows))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    held_out = jnp.asarray(eval_windows(val_tokens, args.seq_len, args.eval_windows))
    record = MetricsLog(work / "metrics.jsonl").record

    def held_out_eval(step):
        loss = float(evaluate(params, held_out))
        result = {"val_loss": loss, "val_ppl": math.exp(loss), "val_bits_per_byte": loss / math.log(2) * tokens_per_byte}
        record(step, **result)
        return result

    t_start = time.time()
    step = start
    if not args.export_only:
        print(f"model: {cfg.num_params / 1e6:.2f}M parameters; train split {len(train_tokens):,} tokens", file=sys.stderr)
        bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="pretrain", dynamic_ncols=True)
        with stop_on_interrupt() as interrupt:
            for step in bar:
                windows = jnp.asarray(batch_at(train_tokens, step, args.batch_size, args.seq_len, args.seed))
                params, opt_state, loss = train_step(params, opt_state, windows)
                done = step + 1
                if done % 10 == 0:
                    loss = float(loss)
                    record(done, loss=loss)
                    bar.set_postfix(loss=f"{loss:.3f}")
                if done % args.eval_every == 0 or done == args.steps:
                    bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in held_out_eval(done).items()))
                if done % args.ckpt_every == 0 or done == args.steps:
                    manager.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
                if stop_due(done, args, t_start, interrupt):
                    if done % args.ckpt_every:
                        manager.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
                    manager.wait_until_finished()
                    print(f"stopped at step {done}; rerun to resume", file=sys.stderr)
                    return cli.INTERRUPTED if interrupt.is_set() else 0
        manager.wait_until_finished()
        step = args.steps
    final = held_out_eval(step)
    export(nnx.merge(graphdef, params), tok_dir, Path(args.out), step, final, args)
    print(f"exported step {step} to {args.out}: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items()))
    return 0


def export(model: Llama, tok_dir: Path, out: Path, step: int, final: dict, args) -> None:
    """The HF checkpoint: bfloat16 weights, config, tokenizer, generation config, the data split."""
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out, dtype=jnp.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "split.json"):
        copy_file(tok_dir / name, out / name)
    eos = model.cfg.eos_token_ids[0]
    gen = {"bos_token_id": model.cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": eos,
           "do_sample": False, "max_new_tokens": 128}
    write_text(out / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    summary = {"step": step, **final, "params": model.cfg.num_params,
               "args": {k: v for k, v in vars(args).items() if k not in ("export_only",)}}
    write_text(out / "train_summary.json", json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    cli.exit(main())
