"""Measure exported draft heads on a dataset, as train.train measures them while training.

    python -m train.evaluate --heads models/smollm2/heads/eagle3 --base smollm2 --data data/smollm2-sharegpt-640f

Prints the held-out figures train.train records (loss, each head's top-1 and top-5 accuracy, the chain
tau through the first 1, 2, ... heads, greedy and when sampling at temperature 1) for heads as they
are stored, on another dataset or split than they were trained with. Heads exported before train.train recorded the chain tau per depth can gain
it with `--record`, which `--tree auto` on a CPU then picks its chain depth by.

`--tree SPEC` also replays decoding on a static tree, exactly as the engine steps greedy, and
`--fit-tree N` fits an N-node tree to where the heads' drafts hit on the data (`clover_jax.tree.fit`);
with `--record` it becomes the heads' tree.json, which `--tree default` drafts from then on:

    python -m train.evaluate --heads models/smollm2/heads/clover2 --base smollm2 --data DATA \
        --tree paper --fit-tree 26 --record
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from clover_jax import Tree, load_pretrained, resolve_tree
from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io.files import write_text
from clover_jax.training import (CONFIG, TREE, DraftVocab, is_ours, load_fitted_tree, load_heads, load_token_counts,
                                 read_heads_config, save_fitted_tree)
from clover_jax.trees.fit import fit
from train import losses
from train.losses import tau_of
from train import train
from train.train import head_loss, on_devices, open_dataset, stores_features
from clover_jax.io import sources

RECORD = "evaluated"  # the heads.json entry --record writes; train.train's own figures stay under "held_out"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.evaluate",
        description="Measure draft heads written by train.train on a dataset written by train.make_data: the "
                    "loss, each head's top-1/top-5 accuracy and the chain tau (decoding's steps replayed over the "
                    "responses) through the first 1, 2, ... heads. The window, batch and loss vocabulary default "
                    "to the heads' own training settings (heads.json), so the figures compare with its held_out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", "--heads", dest="heads", required=True, metavar="DIR",
                   help="the drafter (draft heads or a draft model; --heads is the same flag, by its older name): "
                        "a directory written by train.train, or a published drafter as infer.generate's --drafter "
                        "reads it (a folder or Hub id: SpecForge/SGLang, speculators or EAGLE authors' EAGLE-3, "
                        "Medusa-1), measured with train.train's default settings")
    p.add_argument("--base", required=True, metavar="DIR|NAME",
                   help="the base model the heads were trained for (a checkpoint directory, or smollm2)")
    p.add_argument("--data", required=True, metavar="DIR", help="dataset directory written by train.make_data")
    p.add_argument("--split", choices=("held-out", "all"), default="held-out",
                   help="the dataset's held-out split (train.train's, by --val-fraction) or every example")
    p.add_argument("--val-fraction", type=float, metavar="F",
                   help="share of examples held out (default: the heads' training setting, else 0.05)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per window (default: the heads' training setting)")
    p.add_argument("--batch-size", type=int, metavar="N", help="windows per batch (default: the heads' training setting)")
    p.add_argument("--eval-batches", type=int, metavar="N",
                   help="batches measured (default: the heads' training setting, as train.train's held-out figures)")
    p.add_argument("--loss-vocab", type=int, metavar="N",
                   help="score over the N most frequent tokens of the counts beside the heads, 0 for the whole "
                        "vocabulary (default: the heads' training --loss-vocab); accuracies count a target "
                        "outside it as a miss, as decoding's draft vocabulary does")
    p.add_argument("--tree", action="append", default=[], metavar="SPEC",
                   help="also replay decoding's steps on this static tree (as --tree of infer.generate: default, "
                        "chain:D, widths:..., a JSON file; repeatable) and report its tokens per step")
    p.add_argument("--fit-tree", type=int, metavar="N",
                   help="fit a static tree of N nodes (root included) to where the heads' drafts hit on this data "
                        "(the rank paths that draft the data's tokens most often) and replay it beside the trees "
                        f"of --tree; --tree-out writes it, and --record writes it beside the heads as {TREE}, "
                        "which --tree default then drafts in place of the method's paper tree")
    p.add_argument("--tree-out", metavar="FILE",
                   help="write --fit-tree's tree to this JSON file (for --tree FILE of infer.generate and "
                        "infer.benchmark)")
    p.add_argument("--record", action="store_true",
                   help=f"also write the figures into the heads' {CONFIG} as '{RECORD}' (with the data and "
                        f"settings), beside train.train's own 'held_out', which is kept; and --fit-tree's tree "
                        f"as their {TREE}")
    p.add_argument("--json", metavar="FILE", help="also write the figures and settings to this JSON file")
    cli.add_compile_cache_flag(p)
    return p


def settings(args, trained: dict) -> dict:
    """The evaluation's settings: each flag given, else the heads' training setting, else train.train's default."""
    defaults = train.build_parser()
    out = {k: getattr(args, k) if getattr(args, k) is not None else trained.get(k, defaults.get_default(k))
           for k in ("val_fraction", "seq_len", "batch_size", "eval_batches", "loss_vocab")}
    for name in ("seq_len", "batch_size", "eval_batches"):
        if out[name] < 1:
            raise CloverError(f"--{name.replace('_', '-')} must be >= 1")
    if out["loss_vocab"] < 0:
        raise CloverError("--loss-vocab must be >= 0 (0: the whole vocabulary)")
    return out


def replayed_trees(args, drafter, kept: list) -> dict:
    """The trees of --tree, and the one --fit-tree fits (written to --tree-out, or with --record beside
    the heads), replayed over the kept ranks: {"val_tree_tau": {spec: tokens per step}} (empty without
    either flag). The fit counts where the drafts hit over every position a step could start at."""
    fitted = load_fitted_tree(args.heads, drafter.depth)
    trees = {spec: resolve_tree(spec, drafter.hcfg.method, drafter.depth, fitted_tree=fitted) for spec in args.tree}
    if args.fit_tree:
        counts = {}
        for ranks, loss_mask in kept:
            losses.path_counts(ranks, loss_mask, drafter.depth, counts)
        tree = fit(counts, args.fit_tree, drafter.depth)
        written = [args.tree_out] if args.tree_out else []
        if args.tree_out:
            tree.to_file(args.tree_out, fitted_on=args.data, split=args.split)
        if args.record:  # with the heads' hash, so heads exported over these later do not draft it
            written.append(save_fitted_tree(args.heads, tree, fitted_on=args.data, split=args.split))
        for out in written:
            print(f"fitted tree ({tree.num_nodes} nodes, depth {tree.max_depth}) written to {out}", file=sys.stderr)
        trees[f"fit:{args.fit_tree}"] = tree
    taus = {}
    for spec, tree in trees.items():
        if not isinstance(tree, Tree):
            raise CloverError(f"--tree {spec}: a dynamic tree is chosen per step from the heads' probabilities, "
                              "so it cannot be replayed from where the data's tokens rank; name a static tree")
        hist = sum(losses.tree_steps(ranks, loss_mask, frozenset(tree.paths)) for ranks, loss_mask in kept)
        taus[spec] = tau_of(hist)
        print(f"  tree {spec} ({tree.num_nodes} nodes, depth {tree.max_depth}): tokens per step {taus[spec]:.3f}, "
              f"steps accepting 0, 1, ... drafts {np.round(hist / hist.sum(), 3).tolist()}")
    return {"val_tree_tau": taus} if taus else {}


def recorded(before: dict | None, report: dict) -> dict:
    """What --record writes as heads.json's RECORD: the new report, keeping the trees replayed before on the
    same data and split that this run did not replay again (so measuring one more figure loses none)."""
    if not isinstance(before, dict) or (before.get("data"), before.get("split")) != (report["data"], report["split"]):
        return report
    trees = {**(before.get("val_tree_tau") or {}), **(report.get("val_tree_tau") or {})}
    return {**before, **report, **({"val_tree_tau": trees} if trees else {})}


def run(args) -> int:
    cli.use_compile_cache(args.compile_cache)
    for flag, path in (("--json", args.json), ("--tree-out", args.tree_out)):
        if path and not Path(path).resolve().parent.is_dir():
            raise CloverError(f"{flag} {path}: its folder does not exist; create it or write elsewhere")
        if path:
            cli.check_output_file(path, flag)
    args.heads = str(sources.drafter_path(args.heads))  # a Hub id of a published drafter: its files
    ours = is_ours(args.heads)
    if args.record and not ours:
        raise CloverError(f"--record writes into our heads' {CONFIG}; {args.heads} holds a published drafter (no "
                          f"{CONFIG}): drop --record (--json FILE keeps the figures, --tree-out FILE the tree)")
    if args.record:  # heads.json and tree.json are rewritten there, after the measuring
        cli.check_output_dir(args.heads, "--record")
    if args.fit_tree is not None and args.fit_tree < 2:
        raise CloverError(f"--fit-tree {args.fit_tree} must be >= 2 (the root and one draft)")
    if args.tree_out and not args.fit_tree:
        raise CloverError("--tree-out writes the tree --fit-tree N fits; add --fit-tree N")
    meta = read_heads_config(args.heads) if ours else {}  # a published drafter: train.train's defaults
    s = settings(args, meta.get("training") or {})
    _, base = load_pretrained(sources.model_dir(args.base), dtype=jnp.float32)
    drafter = load_heads(args.heads, base)
    train.check_seq_len(s["seq_len"], drafter.depth)
    nnx.update(drafter, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(drafter, nnx.Param)))
    data = open_dataset(args.data, base)
    indices = data.split(s["val_fraction"])[1] if args.split == "held-out" else None
    vocab = None
    if s["loss_vocab"]:
        counts = load_token_counts(args.heads, base.cfg.vocab_size)
        if counts is None:
            raise CloverError(f"{args.heads}: no token counts to pick --loss-vocab's tokens from; pass --loss-vocab 0")
        vocab = DraftVocab.most_frequent(base.lm_head_weight(), counts, min(s["loss_vocab"], base.cfg.vocab_size))
    graphdef, params, fixed = nnx.split(drafter, nnx.Param, ...)
    base_graphdef, base_params = nnx.split(base)

    @jax.jit
    def evaluate(p, bp, batch):
        drafter_now, base_now = nnx.merge(graphdef, p, fixed), nnx.merge(base_graphdef, bp)
        return head_loss(drafter_now, base_now, batch, with_ranks=True, vocab=vocab)[1]

    stored_features = stores_features(data, drafter)

    def batch_metrics(batch):
        return evaluate(params, base_params, on_devices(batch, jnp.asarray, stored_features))

    kept = []
    figures = losses.held_out_figures(batch_metrics, data.eval_batches(s["seq_len"], s["batch_size"], indices),
                                      s["eval_batches"], kept)
    if not figures:
        raise CloverError(f"{args.data}: no example in its {args.split} split to measure")
    report = {"data": args.data, "split": args.split, **s, **figures}  # the data as named, like "training"
    print(f"{drafter.hcfg.method} heads in {args.heads} on {args.data} ({args.split}): "
          f"loss {figures['val_loss']:.4f}, top-1 per head {[round(a, 3) for a in figures['val_top1']]}, "
          f"chain tau through 1, 2, ... heads {[round(t, 3) for t in figures['val_chain_tau_by_depth']]}")
    for temperature, taus in figures["val_sampled_chain_tau_by_depth"].items():
        print(f"  sampled at temperature {temperature}: chain tau through 1, 2, ... heads "
              f"{[round(t, 3) for t in taus]}")
    report.update(replayed_trees(args, drafter, kept))
    if args.json:
        write_text(args.json, json.dumps(report, indent=2) + "\n")
    if args.record:
        meta[RECORD] = recorded(meta.get(RECORD), report)
        write_text(Path(args.heads) / CONFIG, json.dumps(meta, indent=2) + "\n")
        print(f"recorded as '{RECORD}' in {Path(args.heads) / CONFIG}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    cli.exit(main())
