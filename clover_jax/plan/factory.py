"""What a generation is built from, planned on the host: which drafter (the heads shipped beside the
model, a heads directory, or random ones), which tree (a `--tree` spec, `auto` resolved for this
machine), which step cost to pace it by, and the `Generator` or `SpeculativeGenerator` made of them.

The command-line tools, the benchmark and the Python API (`clover_jax.api`) all build their
generators here, so a method, tree or pacing means the same thing everywhere. A drafter is loaded
once (`load_drafter`) and can be handed to any number of generators (the benchmark's temperatures
and batch sizes share one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from clover_jax.drafters import BUILT_IN
from clover_jax.drafters import registry
from clover_jax.drafters.base import Drafter
from clover_jax.drafters.heads import make_heads
from clover_jax.drafters.registry import drafter_config
from clover_jax.drafters.vocab import DraftVocab
from clover_jax.engine.chunks import DEFAULT_LOOP_CHUNK
from clover_jax.engine.decode import BUCKETS, Generator
from clover_jax.engine.speculative import SpeculativeGenerator
from clover_jax.errors import CloverError
from clover_jax.io import sources
from clover_jax.io.heads_dir import held_out_chain_tau, load_draft_vocab, load_fitted_tree, load_heads
from clover_jax.model.llama import Llama
from clover_jax.plan.auto import PLAIN, auto_tree, step_cost_for
from clover_jax.plan.step_cost import chain_cost
from clover_jax.trees.spec import resolve_tree
from clover_jax.trees.static import Tree

METHODS = ("plain",) + BUILT_IN  # what a generator decodes with: plain, or a draft method


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
    """A drafter loaded for one base model, and the directory it came from, which also holds what
    planning reads beside the weights: the held-out chain tau (`--tree auto`), the fitted tree
    (`--tree default`) and the token counts (`--draft-vocab`)."""

    method: str  # a `registry` method name
    drafter: Drafter  # heads (Medusa, Clover, Clover-2) or a draft model (EAGLE-1, EAGLE-3)
    heads_dir: Path | None  # None: random, untrained heads

    @property
    def num_heads(self) -> int:
        """Draft steps it takes: the deepest tree it can draft."""
        return self.drafter.num_heads

    @property
    def chain_tau(self) -> list[float] | None:
        """Held-out tokens per step of chains through the first 1, 2, ... heads, greedy (None: not recorded)."""
        return held_out_chain_tau(self.heads_dir)

    @property
    def sampled_chain_tau(self) -> list[float] | None:
        """The same when sampling (at temperature 1; None: not recorded)."""
        return held_out_chain_tau(self.heads_dir, sampling=True)

    def fitted_tree(self) -> Tree | None:
        """The static tree fitted to these heads (their tree.json), or None."""
        return load_fitted_tree(self.heads_dir, self.num_heads)

    def vocab(self, model: Llama, spec: str | int | None = "auto", greedy: bool = True) -> DraftVocab | None:
        """The draft vocabulary a `--draft-vocab` value asks for (`heads_dir.load_draft_vocab`)."""
        return load_draft_vocab(self.heads_dir, model, spec, greedy)


def load_drafter(model: Llama, method: str, *, model_path=None, heads: str | Path | None = None,
                 num_heads: int | None = None, seed: int = 0, model_dir: Path | None = None) -> LoadedDrafter:
    """The drafter of `method` for `model`: the heads in `heads` (a directory, or a Hub id such as org/name
    whose drafter files are downloaded, `sources.drafter_snapshot`; "random" for untrained ones,
    `num_heads` of them, seeded by `seed`; None or "shipped" for the ones shipped beside the model
    `model_path` names, a `--model` value, whose checkpoint directory `model_dir` is when already found)."""
    if method == "plain":
        raise CloverError(f"plain decoding drafts nothing; choose a draft method: {', '.join(registry.names())}")
    registry.get(method)  # an unknown method is one line naming the known ones
    if heads == "random":
        if num_heads is not None and num_heads < 1:
            raise CloverError(f"num_heads={num_heads}: random heads need at least one head")
        return LoadedDrafter(method, make_heads(drafter_config(method, num_heads), model,
                                                seed=seed), None)
    if heads in (None, "shipped"):
        shipped = sources.heads_root(model_path, model_dir or sources.model_dir(model_path)) / method
        if not shipped.is_dir():
            raise CloverError(f"no {method} heads at {shipped}; pass --heads DIR, or --heads random for untrained heads")
        heads = shipped
    heads = sources.drafter_path(heads)  # a Hub id (not a local folder): its drafter files, downloaded
    return LoadedDrafter(method, load_heads(heads, model, method), Path(heads))


def plan_tree(model: Llama, drafter: LoadedDrafter, vocab: DraftVocab | None, *, tree, greedy: bool,
              step_cost: str | float | None, mesh=None) -> tuple[str | Tree | None, float | None]:
    """(the tree to draft, or PLAIN; the step cost to pace it by) for a `--tree` and a `--step-cost`
    value: `auto` picks by the heads' held-out chain tau (greedy, or when sampling the sampled one) and,
    on a CPU, this machine's timed chain step cost (`step_cost.chain_cost`, timed once and kept); any
    other tree is as given."""
    sampling = not greedy
    timed = chain_cost(model, drafter.drafter, vocab, sampling, mesh) if tree == "auto" else None
    taus = drafter.sampled_chain_tau if sampling else drafter.chain_tau
    picked = auto_tree(drafter.num_heads, chain_tau=taus, sampling=sampling, cost=timed)
    spec = picked if tree == "auto" else tree
    return spec, None if spec == PLAIN else step_cost_for(step_cost, tree, picked, sampling=sampling, cost=timed)


def _drafter_for(model: Llama, method: str, drafter: LoadedDrafter | None, **load) -> LoadedDrafter:
    """`drafter` when given (it must be of `method`), else `method`'s loaded by `load_drafter(**load)`."""
    if drafter is None:
        return load_drafter(model, method, **load)
    if drafter.method != method:
        raise CloverError(f"the drafter given is {drafter.method}'s, not {method}'s; pass matching ones")
    return drafter


def drafting_plan(model: Llama, method: str, *, drafter: LoadedDrafter | None = None, model_path=None,
                  heads: str | Path | None = None, tree=None, num_heads: int | None = None, seed: int = 0, mesh=None,
                  draft_vocab: str | int | None = "auto", greedy: bool = True,
                  step_cost: str | float | None = "auto") -> tuple[str | Tree | None, float | None]:
    """What `make_generator` drafts with these arguments: `plan_tree`'s (tree spec or PLAIN, step cost)."""
    drafter = _drafter_for(model, method, drafter, model_path=model_path, heads=heads, num_heads=num_heads, seed=seed)
    return plan_tree(model, drafter, drafter.vocab(model, draft_vocab, greedy), tree=tree, greedy=greedy,
                     step_cost=step_cost, mesh=mesh)


def make_generator(model: Llama, method: str, *, drafter: LoadedDrafter | None = None, model_path=None,
                   heads: str | Path | None = None, tree=None, num_heads: int | None = None,
                   max_len: int | None = None, seed: int = 0, mesh=None, draft_vocab: str | int | None = "auto",
                   greedy: bool = True, buckets=BUCKETS, step_cost: str | float | None = "auto",
                   loop_chunk: int = DEFAULT_LOOP_CHUNK) -> Generator:
    """The generator for `method`: plain, or a speculative one with its drafter (`drafter`, already
    loaded, else `load_drafter`'s from `model_path`, `heads`, `num_heads` and `seed`), its tree (a spec
    or a `Tree`; None for the method's default), its draft vocabulary (a `--draft-vocab` value; `greedy`
    says which `auto` means) and its pacing (a `--step-cost` value), as `plan_tree` plans them;
    `buckets` are the prompt lengths it pads to and `loop_chunk` the decoding steps per chunk of its loop
    (`Generator`; `chunks.chunked`). Tree `auto` with heads no chain of which
    pays here (PLAIN) gives a plain generator: drafting would only slow it."""
    if max_len is not None and max_len < 2:
        raise CloverError(f"--max-len {max_len} must be >= 2 (a prompt token plus a new one)")
    if method == "plain":
        return Generator(model, max_len=max_len, mesh=mesh, buckets=buckets, loop_chunk=loop_chunk)
    drafter = _drafter_for(model, method, drafter, model_path=model_path, heads=heads, num_heads=num_heads, seed=seed)
    vocab = drafter.vocab(model, draft_vocab, greedy)
    spec, cost = plan_tree(model, drafter, vocab, tree=tree, greedy=greedy, step_cost=step_cost, mesh=mesh)
    if spec == PLAIN:
        return Generator(model, max_len=max_len, mesh=mesh, buckets=buckets, loop_chunk=loop_chunk)
    drafted = resolve_tree(spec, method, drafter.num_heads, fitted_tree=drafter.fitted_tree())
    return SpeculativeGenerator(model, drafter.drafter, drafted, max_len=max_len,
                                buckets=buckets, mesh=mesh, draft_vocab=vocab, step_cost=cost, loop_chunk=loop_chunk)
