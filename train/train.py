"""Train a drafter (draft heads or a draft model) on a frozen base model.

    python -m train.train --method clover2 --base models/reference --data data/heads --out models/reference/heads/clover2

Only the drafter is trained: the base model's parameters enter the loss as a separate, stop-gradient
argument, and the optimizer state covers the drafter alone. Every method trains the same way: its
drafter's `train_forward` drafts teacher-forced, its registry entry's loss scores that. Batches are a
pure function of (seed, step) and orbax saves the drafter, optimizer state and step together, so
`--resume` after a kill continues exactly.
`--backbone DIR` trains only a correction on a trained drafter (DFlash + Clover cell on a DFlash one): DIR's
parameters are fixed, and neither the optimizer nor the checkpoints hold them; the export holds them all.
The result is exported as safetensors + JSON (`clover_jax.io.heads_dir`) that `infer.generate --heads`
loads.
"""

from __future__ import annotations

import argparse
import hashlib
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

from clover_jax import DTYPES, Llama, load_pretrained
from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io.files import check_free_space, sha256
from clover_jax.training import (HEADS, WEIGHTS, Drafter, DraftVocab, causal_self_mask, drafter_config, export_bytes,
                                 load_heads, onto_mesh, probability_mass, put_batch, registry, save_heads, shard_module,
                                 shift_left, targets_and_masks, to_host, token_counts)
from train import export, losses
from train.options import backbone_drafter, method_option, method_options, options_help
from train.data import HeadDataset
from train.runs import (MetricsLog, check_checkpoint_space, no_space_in, pin_run, restore_latest, stop_due,
                        stop_on_interrupt)
from clover_jax.io import sources

MASS_EXAMPLES = 256  # the exported probability mass sums over at most this many examples, evenly spaced


def base_states(base: Llama, tokens: jax.Array, hidden: jax.Array | None, feature_layers: tuple[int, ...] = (),
                vocab: DraftVocab | None = None, features: jax.Array | None = None):
    """(hidden, hidden_normed, logits, features) of the frozen base at every position: from the stored
    hidden states (and the stored outputs of `feature_layers`, `features` [B, T, F, D], when inner layers
    are asked for) when the dataset has them, else from a forward pass (features: the outputs of
    `feature_layers`, None without); logits over `vocab` (None: the whole vocabulary); never differentiated."""
    features = features if feature_layers else None
    if hidden is None or (feature_layers and features is None):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = base(tokens, positions, causal_self_mask(b, t), with_logits=False, feature_layers=feature_layers,
                   causal=True)
        hidden, features = out.hidden, out.features
    features = None if features is None else jax.lax.stop_gradient(features.astype(base.dtype))
    hidden = jax.lax.stop_gradient(hidden.astype(base.dtype))
    normed = base.norm(hidden)
    logits = base.logits(normed) if vocab is None else vocab.logits(normed)
    return hidden, normed, jax.lax.stop_gradient(logits), features


def token_mass(base: Llama, data: HeadDataset, indices: np.ndarray, seq_len: int, batch_size: int,
               place) -> np.ndarray:
    """[V] the base model's probability mass (`draft_vocab.probability_mass`) before each response token
    of the examples `indices` names, one window of `seq_len` each (MASS_EXAMPLES of them at most, evenly
    spaced: enough to rank the tokens that hold nearly all of it). `place` puts a host batch on the
    devices. What `--draft-vocab auto` picks from when sampling."""
    indices = np.asarray(indices)
    if not len(indices):
        return np.zeros(base.cfg.vocab_size, np.float64)
    picked = indices[np.linspace(0, len(indices) - 1, min(len(indices), MASS_EXAMPLES)).round().astype(int)]
    graphdef, params = nnx.split(base)

    @jax.jit
    def mass_of(params, tokens, hidden, loss_mask):
        _, _, logits, _ = base_states(nnx.merge(graphdef, params), tokens, hidden)
        return probability_mass(logits, shift_left(loss_mask, 1))  # position t predicts token t + 1

    total = np.zeros(base.cfg.vocab_size, np.float64)
    batches = data.eval_batches(seq_len, batch_size, picked)
    for batch in tqdm(batches, total=-(-len(picked) // batch_size), desc="probability mass", dynamic_ncols=True):
        hidden = None if batch["hidden"] is None else place(batch["hidden"])
        total += to_host(mass_of(params, place(batch["tokens"]), hidden, place(batch["loss_mask"])))
    return total


def stores_features(data: HeadDataset, drafter: Drafter) -> bool:
    """Whether `data` stores the outputs of the very layers `drafter` drafts from (EAGLE-3's), so that no
    base forward need compute them."""
    return bool(drafter.feature_layers) and data.feature_layers == tuple(drafter.feature_layers)


def on_devices(batch: dict, place, features: bool) -> dict:
    """A host batch's arrays for `head_loss`, put on the devices by `place`; stored features only when
    `features` (`stores_features`), else `base_states` computes what it needs."""
    return {k: place(v) for k, v in batch.items() if v is not None and (k != "features" or features)}


def head_loss(drafter: Drafter, base: Llama, batch: dict, with_ranks: bool = False, key: jax.Array | None = None,
              vocab: DraftVocab | None = None, steps: int | None = None):
    """(loss, metrics) of one batch: the method's loss plus per-head losses and top-1/top-5 accuracy;
    `with_ranks` adds where each target ranks in its head's logits [K, B, T] (`losses.target_ranks`),
    which evaluation replays decoding's steps from, and the chance each draft is kept when sampling
    ([S, K, B, T], `losses.accept_probability` at each of `losses.SAMPLED_TEMPERATURES`).
    `key`: a training step's randomness (EAGLE-1's feature noise); None in evaluation.

    `vocab` (a loss vocabulary, `--loss-vocab`): drafter and base model are scored over its N tokens
    only, the distributions renormalised over them, which makes the vocabulary projections V/N times
    cheaper; a response token outside it is no target of the loss, but still a miss in the accuracies
    and the chain tau, as it is for decoding's draft vocabulary."""
    tokens, mask = batch["tokens"], batch["loss_mask"]
    vocab = drafter.loss_vocab(base, vocab)
    hidden, normed, base_logits, features = base_states(base, tokens, batch.get("hidden"), drafter.feature_layers,
                                                        vocab, batch.get("features"))
    # [K, B, T, D] and [K, B, T, V or N]
    head_hidden, head_logits = drafter.train_forward(base, tokens, hidden, normed, features, vocab, key, steps)
    labels, label_mask = tokens, mask
    if vocab is not None:
        labels = vocab.index_of(tokens, base.cfg.vocab_size)  # [B, T], -1 outside the loss vocabulary
        label_mask = mask * (labels >= 0)
    method_loss = registry.get(drafter.hcfg.method).loss
    loss, per_head, _, _ = method_loss(head_hidden, head_logits, normed, base_logits, jnp.maximum(labels, 0),
                                       label_mask, hidden)
    targets, masks = targets_and_masks(labels, mask, head_logits.shape[0])
    head_logits = drafter.drafted_logits(base, head_hidden, head_logits, vocab)  # the metrics score decoding's drafts
    metrics = {"loss": loss, "head_loss": per_head,
               "top1": losses.topk_accuracy(head_logits, targets, masks, 1),
               "top5": losses.topk_accuracy(head_logits, targets, masks, 5)}
    if with_ranks:
        metrics["ranks"] = losses.target_ranks(head_logits, targets, masks)
        metrics["accept"] = jnp.stack([losses.accept_probability(head_logits, base_logits, masks, t)
                                       for t in losses.SAMPLED_TEMPERATURES])
    return loss, metrics


def make_optimizer(args) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    return optax.chain(optax.clip(0.5), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0))


def own_vocab_titles() -> str:
    """The registered methods whose drafters score over a vocabulary of their own (`Drafter.own_vocab`),
    as messages name them: what --draft-vocab applies to."""
    return ", ".join(registry.title(m) for m in registry.names() if registry.get(m).drafter.own_vocab)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.train",
        description="Train a drafter (draft heads or a draft model, --method) on a frozen base model, from a "
                    "dataset made by train.make_data. Rerun with --resume to continue a killed run exactly.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=registry.names(), required=True, help="draft method to train")
    p.add_argument("--base", required=True, metavar="DIR", help="base model (Hugging Face checkpoint directory)")
    p.add_argument("--data", required=True, metavar="DIR", help="dataset directory written by train.make_data")
    p.add_argument("--eval-data", metavar="DIR",
                   help="take the held-out figures from this dataset's held-out split instead of --data's, e.g. "
                        "heads trained on ShareGPT's own replies (make_data --mode fixed --first N) measured on the "
                        "base model's own answers (default: --data)")
    p.add_argument("--counts-from", metavar="DIR",
                   help="count the response tokens of this dataset's training split, not --data's, for the token "
                        "counts and probability mass the heads export (what --draft-vocab auto picks from when "
                        "decoding greedily and when sampling), --loss-vocab and --draft-vocab: the base model's own "
                        "answers, when --data adds text it did not write (default: all of --data)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the final heads (safetensors + JSON) go")
    p.add_argument("--work-dir", metavar="DIR", help="orbax checkpoints and metrics.jsonl (default: OUT/../run-METHOD)")
    p.add_argument("--num-heads", type=cli.at_least(1), help="number of heads (default: " + ", ".join(f"{m} {registry.get(m).depth}" for m in HEADS) + ")")
    p.add_argument("--embed-source", choices=("lm_head", "input"),
                   help="Clover-2 token embeddings: a frozen copy of lm_head (default), or the input embedding table")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help=f"{own_vocab_titles()}: its lm_head scores the N most frequent response tokens of the "
                        "data (0: all)")
    p.add_argument("--loss-vocab", type=int, default=0, metavar="N",
                   help="score the losses over the N most frequent response tokens of the data only (0: the "
                        "whole vocabulary), as decoding drafts from a draft vocabulary: the vocabulary "
                        "projections, most of a step on a CPU, cost N/V as much (SmolLM2: 8192 of 49,152). "
                        f"{own_vocab_titles()} always scores its own --draft-vocab")
    p.add_argument("--option", action="append", type=method_option, metavar="NAME=VALUE",
                   help="set one of the method's own options (repeat the flag for more; a comma list is a list), "
                        "e.g. --option draft_layers=2 --option target_layer_ids=1,14,26 for DFlash. "
                        f"Each method's: {options_help()}")
    p.add_argument("--init-from", metavar="HEADS",
                   help="start from these trained heads instead of a fresh initialisation, and train them on "
                        "with a new schedule and new optimizer state: a directory train.train exported (e.g. "
                        "models/smollm2/heads/clover2), or a published drafter as --heads reads it (a folder or "
                        "Hub id of SpecForge/SGLang, speculators or EAGLE authors' EAGLE-3, Medusa-1, EAGLE-1); "
                        "they keep their own number of heads, embedding source, draft vocabulary and feature layers")
    p.add_argument("--backbone", metavar="HEADS",
                   help="train only the correction of a method that names a frozen backbone (dflash_clover: a "
                        "trained dflash drafter, e.g. models/smollm2/heads/dflash), on that drafter's fixed weights")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (the schedule's length)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training window")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, betas 0.9/0.95)")
    p.add_argument("--warmup", type=int, default=50, help="linear warmup steps before the cosine decay")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                   help="compute dtype of the base model and heads (optimizer state stays float32)")
    p.add_argument("--export-dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype the exported heads are stored in (bfloat16: half the bytes, as shipped heads are); "
                        "loading casts them to the base model's")
    p.add_argument("--export-format", action="append", metavar="NAME",
                   help="also write the heads in another project's drafter format into OUT-NAME beside --out, after "
                        "our own export (repeat the flag or give a comma list; as python -m train.export --format "
                        f"writes them): {export.FORMATS_HELP}; stored in --export-dtype")
    p.add_argument("--eval-every", type=int, default=100,
                   help="held-out evaluation period (steps): loss, each head's top-1/top-5 accuracy, and the "
                        "chain tau, the tokens per step a chain through every head would reach, from decoding's "
                        "steps replayed over the held-out responses")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of examples held out")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint period (steps)")
    p.add_argument("--keep", type=int, default=2, help="latest checkpoints kept (the best one is kept too)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --work-dir")
    p.add_argument("--seed", type=cli.seed, default=0,
                   help="head initialisation and batch-order seed, 0 to 2**32-1; a resumed run keeps its own")
    p.add_argument("--stop-after", type=int, default=0, metavar="STEP",
                   help="stop cleanly (checkpoint, no export) once this step is done, as a kill would; "
                        "0 = run to --steps")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="stop cleanly (checkpoint, no export) after this many minutes; 0 = no limit")
    cli.add_mesh_flags(p, "base, heads, optimizer state and batches", "; a resumed run may use another mesh")
    cli.add_compile_cache_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


def check_seq_len(seq_len: int, depth: int, flag: str = "--seq-len") -> None:
    """Refuse a window too short to give every head a target: head k (from 0) at position t learns token
    t + 2 + k, so `depth` heads need depth + 2 tokens; a shorter one trains and measures nothing."""
    if seq_len < depth + 2:
        raise CloverError(f"{flag} {seq_len}: a window of {depth} heads' targets needs at least {depth + 2} tokens "
                          f"(head k learns the token k + 2 ahead); give {flag} {depth + 2} or more")


def check_finite(loss: float, step: int, args, settle) -> None:
    """Stop a run whose training loss is NaN or infinite, in one line, before its weights are checkpointed or
    exported (the checkpoints already saved, of finite steps, are let finish: `settle`, and stay)."""
    if np.isfinite(loss):
        return
    settle()
    raise CloverError(f"step {step}: the training loss is {loss}; nothing saved or exported from it: lower --lr "
                      f"({args.lr}) or check the data, and start again (earlier checkpoints are kept)")


def open_dataset(path: str, base: Llama) -> HeadDataset:
    """A dataset made with `base` over its vocabulary, or one clear error."""
    data = HeadDataset(path)
    data.check_base(base)
    data.check_vocab(base.cfg.vocab_size)
    return data


def weights_sha256(folder: str | Path) -> str:
    """sha256 of the weights of an --init-from drafter: our heads' weights file, or every safetensors file
    of a published drafter's folder in name order."""
    folder = Path(folder)
    files = [folder / WEIGHTS] if (folder / WEIGHTS).is_file() else sorted(folder.glob("*.safetensors"))
    return sha256(*files)


def run(args) -> int:
    cli.use_compile_cache(args.compile_cache)
    for name in ("steps", "batch_size", "seq_len", "eval_every", "ckpt_every", "keep"):
        if getattr(args, name) < 1:
            raise CloverError(f"--{name.replace('_', '-')} must be >= 1")
    # Checked before the base model loads; written only at the end, so a bad path must not wait for the training.
    cli.check_output_dir(args.out, "--out")
    exports = export.parse_formats(args.export_format, args.method)
    for name in exports:
        export.check_out(export.export_dir(args.out, name), flag="--export-format")
    work = Path(args.work_dir or Path(args.out).parent / f"run-{args.method}").resolve()
    cli.check_output_dir(work, "--work-dir")
    dtype = DTYPES[args.dtype]
    mesh = cli.mesh_of(args)
    _, base = load_pretrained(sources.model_dir(args.base), dtype=dtype, mesh=mesh)
    data = open_dataset(args.data, base)
    if args.seq_len > base.cfg.max_position_embeddings:
        raise CloverError(f"--seq-len {args.seq_len} exceeds the base model's context "
                          f"({base.cfg.max_position_embeddings}); lower it")
    train_idx, val_idx = data.split(args.val_fraction)
    held = data
    if args.eval_data:
        held = open_dataset(args.eval_data, base)
        val_idx = held.split(args.val_fraction)[1]
    frozen = frozenset()  # the paths of the parameters --backbone fixes
    if args.backbone:
        drafter, frozen = backbone_drafter(args, base)
        hcfg = drafter.hcfg
    elif args.init_from:
        args.init_from = str(sources.drafter_path(args.init_from))  # a Hub id of a published drafter: its files
        drafter = load_heads(args.init_from, base, method=args.method)
        hcfg = drafter.hcfg
        for flag, asked, theirs in (("--num-heads", args.num_heads, hcfg.num_heads),
                                    ("--embed-source", args.embed_source, getattr(hcfg, "embed_source", None)),
                                    ("--draft-vocab", args.draft_vocab, getattr(hcfg, "draft_vocab", None))):
            if asked and asked != theirs:
                raise CloverError(f"--init-from {args.init_from} holds heads with {flag} {theirs}, not {asked}; "
                                  f"drop {flag} (the heads keep their own)")
        if args.option:
            raise CloverError(f"--init-from {args.init_from} keeps its own options; drop --option "
                              f"{' '.join(f'{k}=...' for k, _ in args.option)}")
    else:
        hcfg = drafter_config(args.method, args.num_heads, **method_options(args))
        drafter = registry.make_drafter(hcfg, base, seed=args.seed)
    check_seq_len(args.seq_len, drafter.depth)
    # The exported counts and probability mass: of --counts-from's training split, else of all of --data
    # (as runs before --counts-from counted, so that a drafter's own draft ids stay the same when it resumes).
    counted = open_dataset(args.counts_from, base) if args.counts_from else data
    counted_idx = counted.split(args.val_fraction)[0] if args.counts_from else np.arange(data.num_examples)
    counts = token_counts(counted.tokens, counted.loss_mask * counted.example_mask(counted_idx), base.cfg.vocab_size)
    if args.draft_vocab and not args.init_from:  # an initial drafter keeps the draft ids it was trained on
        if not drafter.own_vocab:
            raise CloverError(f"--draft-vocab is {own_vocab_titles()}'s own lm_head; {args.method} drafts from "
                              "the base model's")
        if args.draft_vocab > base.cfg.vocab_size:
            raise CloverError(f"--draft-vocab {args.draft_vocab} exceeds the vocabulary ({base.cfg.vocab_size})")
        drafter.set_vocab(base, DraftVocab.most_frequent(base.lm_head_weight(), counts, args.draft_vocab).ids)
    if args.loss_vocab:
        if drafter.own_vocab:
            raise CloverError(f"{registry.title(args.method)} scores its own draft vocabulary; set its size with "
                              "--draft-vocab, not --loss-vocab")
        if not 0 < args.loss_vocab <= base.cfg.vocab_size:
            raise CloverError(f"--loss-vocab {args.loss_vocab} must be in [1, {base.cfg.vocab_size}] (the vocabulary)")
    loss_vocab = DraftVocab.most_frequent(base.lm_head_weight(), counts, args.loss_vocab) if args.loss_vocab else None
    stored_features = stores_features(data, drafter)
    export.check_exportable(drafter, base, exports, args.base)
    # The export's size is known now: a full --out is refused before the training, not after it.
    check_free_space(args.out, export_bytes(drafter, base.cfg.vocab_size, DTYPES[args.export_dtype]), " for the heads")
    # Float32 master weights; the forward casts them to the activations' dtype.
    nnx.update(drafter, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(drafter, nnx.Param)))
    if mesh is not None:
        shard_module(drafter, mesh)
    trained = nnx.All(nnx.Param, lambda path, _: path not in frozen)
    drafter_graphdef, params, fixed = nnx.split(drafter, trained, ...)  # fixed: what is not trained (draft ids, backbone)
    base_graphdef, base_params = nnx.split(base)
    optimizer = make_optimizer(args)
    opt_state = jax.jit(optimizer.init)(params)  # moments placed like the parameters they follow

    check_checkpoint_space(work, sum(x.nbytes for x in jax.tree.leaves((params, opt_state))), args.keep)
    last = ocp.CheckpointManager(work / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=args.keep))
    best = ocp.CheckpointManager(work / "best", options=ocp.CheckpointManagerOptions(
        max_to_keep=1, best_fn=lambda m: m["val_loss"], best_mode="min"))
    # Options a method lacks pin as every run pinned them before each method had a config of its own.
    pin_run(work, {"method": hcfg.method, "num_heads": hcfg.num_heads,
                   "embed_source": getattr(hcfg, "embed_source", "lm_head"), "draft_vocab": getattr(hcfg, "draft_vocab", 0),
                   **({"options": dict(args.option)} if args.option else {}),
                   "base": str(Path(args.base).resolve()), "data": str(Path(args.data).resolve()),
                   "seed": args.seed,  # it draws the batches: a resume with another would not continue the run
                   "counts_from": str(Path(args.counts_from).resolve()) if args.counts_from else None,
                   # What picks a drafter's own draft ids and the loss vocabulary, neither of which the checkpoints hold:
                   # a resume over other counts (the data rebuilt in place, or counted another way) is refused.
                   "token_counts_sha256": hashlib.sha256(np.asarray(counts, np.int64).tobytes()).hexdigest(),
                   **({"eval_data": str(Path(args.eval_data).resolve())} if args.eval_data else {}),
                   # A resume's checkpoint replaces the initial drafter; it may not name another one.
                   **({"init_from_sha256": weights_sha256(args.init_from)} if args.init_from else {}),
                   # The checkpoints hold no backbone: a resume must bring the very one they were trained on.
                   "backbone_sha256": weights_sha256(args.backbone) if args.backbone else None})
    if last.latest_step() is not None and not args.resume:
        raise CloverError(f"{work} already holds checkpoints; pass --resume to continue, or another --work-dir")
    start, restored = restore_latest(last, {"params": params, "opt_state": opt_state})
    params, opt_state = restored["params"], restored["opt_state"]
    if mesh is not None:
        params, opt_state = onto_mesh((params, opt_state), mesh)
    if start > args.steps:
        raise CloverError(f"--steps {args.steps}: {work} holds step {start} already; resume with --steps {start} "
                          "to export it, or more to train on")
    if start:
        print(f"resumed from step {start} in {work}", file=sys.stderr)
    if drafter.feature_layers and not stored_features:
        print(f"{args.method} drafts from layers {list(drafter.feature_layers)}, which {args.data} does not store: "
              "each step runs the base model for them (train.make_data --store-hidden float16 --store-features "
              "stores them)", file=sys.stderr)

    def loss_on(p, bp, batch, with_ranks=False, key=None, steps=None):
        return head_loss(nnx.merge(drafter_graphdef, p, fixed), nnx.merge(base_graphdef, jax.lax.stop_gradient(bp)),
                         batch, with_ranks, key, loss_vocab, steps)

    trained_steps = registry.get(args.method).trained_steps

    @jax.jit
    def train_step(p, opt_state, bp, batch, step):
        key = jax.random.fold_in(jax.random.key(args.seed), step)  # a function of the step: resumes exactly
        (_, metrics), grads = jax.value_and_grad(loss_on, has_aux=True)(p, bp, batch, False, key, trained_steps)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, metrics

    evaluate = jax.jit(lambda p, bp, batch: loss_on(p, bp, batch, with_ranks=True)[1])

    place = jnp.asarray if mesh is None else (lambda x: put_batch(x, mesh))

    def to_device(batch):  # every process computes the whole batch: it is a function of the step
        return on_devices(batch, place, stored_features)

    def held_out(step):
        return losses.held_out_figures(lambda batch: evaluate(params, base_params, to_device(batch)),
                                       held.eval_batches(args.seq_len, args.batch_size, val_idx), args.eval_batches)

    # One metrics file for the run, not one writer per process.
    record = MetricsLog(work / "metrics.jsonl").record if jax.process_index() == 0 else (lambda *a, **k: None)

    def save(step, ev):
        state = {"params": params, "opt_state": opt_state}
        with no_space_in(work, step, (last, best)):  # a save waits for the one before: its failure surfaces here
            last.save(step, args=ocp.args.StandardSave(state))
            if ev:
                best.save(step, args=ocp.args.StandardSave(state), metrics={"val_loss": ev["val_loss"]})

    def settle():
        """Wait for the checkpoints in flight to be written."""
        with no_space_in(work):
            last.wait_until_finished()
            best.wait_until_finished()

    t0 = time.time()
    ev: dict = {}
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"train {args.method}",
               dynamic_ncols=True)
    with stop_on_interrupt() as interrupt:
        for step in bar:
            batch = data.batch_at(step, args.batch_size, args.seq_len, args.seed, train_idx)
            params, opt_state, m = train_step(params, opt_state, base_params, to_device(batch), step)
            done = step + 1
            stopping = stop_due(done, args, t0, interrupt)
            # NaN weights stay NaN, so a loss looked at every 10 steps and before each checkpoint is
            # enough never to save or export them.
            if done % 10 == 0 or done == args.steps or done % args.ckpt_every == 0 or stopping:
                m = jax.device_get(m)
                check_finite(float(m["loss"]), done, args, settle)
            if done % 10 == 0 or done == args.steps:
                record(done, loss=float(m["loss"]), top1=np.asarray(m["top1"]).tolist())
                bar.set_postfix(loss=f"{float(m['loss']):.3f}",
                                top1="/".join(f"{a:.2f}" for a in np.asarray(m["top1"])))
            if done % args.eval_every == 0 or done == args.steps:
                ev = held_out(done)
                if ev:
                    record(done, **ev)
                    bar.write(f"step {done}: val_loss={ev['val_loss']:.4f} "
                              f"top1={[round(a, 3) for a in ev['val_top1']]} "
                              f"top5={[round(a, 3) for a in ev['val_top5']]} chain tau={ev['val_chain_tau']:.2f}")
            if done % args.ckpt_every == 0 or done == args.steps:
                save(done, ev if done % args.eval_every == 0 or done == args.steps else {})
            if stopping:
                if done % args.ckpt_every:
                    save(done, {})
                settle()
                print(f"stopped at step {done}; rerun with --resume", file=sys.stderr)
                return cli.INTERRUPTED if interrupt.is_set() else 0
    settle()
    if not ev:  # resumed after its last step: the export still carries the held-out figures
        ev = held_out(args.steps)
    mass = token_mass(base, counted, counted_idx, args.seq_len, args.batch_size, place)
    if jax.process_count() > 1:  # the export is written once, from every process's shards
        params, fixed = jax.tree.map(to_host, (params, fixed))
        if jax.process_index() != 0:
            return 0
    nnx.update(drafter, params, fixed)
    extra = {"training": {k: v for k, v in vars(args).items() if k != "resume"}, "final_step": args.steps,
             "held_out": ev}
    save_heads(drafter, base, args.out, extra=extra, token_counts=counts, dtype=DTYPES[args.export_dtype],
               token_mass=mass)
    summary = f": held-out top1 {ev['val_top1']}, chain tau {ev['val_chain_tau']:.2f}" if ev else ""
    print(f"saved {args.method} heads to {args.out}{summary}")
    export.write_exports(drafter, base, args.out, exports, args.base, DTYPES[args.export_dtype])
    return 0


if __name__ == "__main__":
    cli.exit(main())
