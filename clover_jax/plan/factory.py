"""What a generation is built from, planned on the host: which drafter (the heads shipped beside the
model, a heads directory, or random ones; none for plain decoding), which tree (a `--tree` spec, `auto`
decided for this machine here and nowhere else), which step cost to pace it by, and the `Generator` or
`SpeculativeGenerator` made of them. What the planner decides is a value, a `DraftPlan`, or None for
plain decoding: with no drafter, or where `auto` finds that no chain of the heads pays on this machine.

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
from clover_jax.io.heads_dir import TREE, held_out_chain_tau, load_draft_vocab, load_fitted_tree, load_heads
from clover_jax.model.llama import Llama
from clover_jax.plan.auto import auto_tree, step_cost_for
from clover_jax.plan.step_cost import chain_cost
from clover_jax.trees.spec import resolve_tree
from clover_jax.trees.dynamic import DynamicTree
from clover_jax.trees.static import Tree

METHODS = BUILT_IN  # the draft methods a generator may draft with (none: plain decoding)


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

    @property
    def ships_fitted_tree(self) -> bool:
        """Whether its directory holds a fitted tree (tree.json), which `--tree default` then drafts."""
        return self.heads_dir is not None and (self.heads_dir / TREE).is_file()

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
    registry.get(method)  # an unknown method is one line naming the known ones
    if heads == "random":
        if num_heads is not None and num_heads < 1:
            raise CloverError(f"num_heads={num_heads}: random heads need at least one head")
        return LoadedDrafter(method, make_heads(drafter_config(method, num_heads), model,
                                                seed=seed), None)
    if heads in (None, "shipped"):
        shipped = sources.heads_root(model_path, model_dir or sources.model_dir(model_path)) / method
        if not shipped.is_dir():
            raise CloverError(f"no {method} heads at {shipped}; pass heads= a heads directory, or heads=random for "
                              "untrained heads", arguments=("heads",))
        heads = shipped
    heads = sources.drafter_path(heads)  # a Hub id (not a local folder): its drafter files, downloaded
    return LoadedDrafter(method, load_heads(heads, model, method), Path(heads))


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """What a speculative generator drafts, as the planner decided it (`plan_tree`); None in its place
    is plain decoding."""

    tree: Tree | DynamicTree  # checked against the drafter that drafts it
    spec: str | Tree | None  # what it was resolved from: the spec given, or the one `auto` stood for
    step_cost: float | None  # the pacing, in plain steps (`pacing.speculate_now`); None: draft at every step
    draft_vocab: DraftVocab | None  # the tokens drafted from; None: the whole vocabulary


def plan_tree(model: Llama, drafter: LoadedDrafter, vocab: DraftVocab | None, *, tree, greedy: bool,
              step_cost: str | float | None, mesh=None) -> DraftPlan | None:
    """The plan for `drafter` drafting from `vocab`, for a `--tree` value (`auto` or a spec for
    `trees.spec.resolve_tree`) and a `--step-cost` value, or None where `auto` decodes plain. This is
    where `auto` is decided: by the heads' held-out chain tau (greedy, or when sampling the sampled
    one) and, on a CPU, this machine's timed chain step cost (`step_cost.chain_cost`, timed once and
    kept; `auto.auto_tree`); any other tree is as given."""
    sampling = not greedy
    timed = None
    spec = tree
    if tree == "auto":
        timed = chain_cost(model, drafter.drafter, vocab, sampling, mesh)
        taus = drafter.sampled_chain_tau if sampling else drafter.chain_tau
        spec = auto_tree(drafter.num_heads, chain_tau=taus, sampling=sampling, cost=timed)
        if spec is None:
            return None
    cost = step_cost_for(step_cost, tree, spec, sampling=sampling, cost=timed)
    drafted = resolve_tree(spec, drafter.method, drafter.num_heads, fitted_tree=drafter.fitted_tree())
    return DraftPlan(tree=drafted, spec=spec, step_cost=cost, draft_vocab=vocab)


def _drafter_for(model: Llama, method: str | None, drafter: LoadedDrafter | None, **load) -> LoadedDrafter:
    """`drafter` when given (of `method`, where that is given), else `method`'s loaded by `load_drafter(**load)`."""
    if drafter is None:
        return load_drafter(model, method, **load)
    if method is not None and drafter.method != method:
        raise CloverError(f"the drafter given is {drafter.method}'s, not {method}'s; pass matching ones")
    return drafter


def plan_drafting(model: Llama, method: str | None, *, drafter: LoadedDrafter | None = None, model_path=None,
                  heads: str | Path | None = None, tree=None, num_heads: int | None = None, seed: int = 0,
                  mesh=None, draft_vocab: str | int | None = "auto", greedy: bool = True,
                  step_cost: str | float | None = "auto") -> DraftPlan | None:
    """What `make_generator` drafts with these arguments (`plan_tree`'s plan), None for plain decoding:
    with no drafter (`method` and `drafter` both None), or where tree `auto` finds none pays here."""
    if method is None and drafter is None:
        return None
    drafter = _drafter_for(model, method, drafter, model_path=model_path, heads=heads, num_heads=num_heads, seed=seed)
    return plan_tree(model, drafter, drafter.vocab(model, draft_vocab, greedy), tree=tree, greedy=greedy,
                     step_cost=step_cost, mesh=mesh)


def make_generator(model: Llama, method: str | None, *, drafter: LoadedDrafter | None = None, model_path=None,
                   heads: str | Path | None = None, tree=None, num_heads: int | None = None,
                   max_len: int | None = None, seed: int = 0, mesh=None, draft_vocab: str | int | None = "auto",
                   greedy: bool = True, buckets=BUCKETS, step_cost: str | float | None = "auto",
                   loop_chunk: int = DEFAULT_LOOP_CHUNK) -> Generator:
    """The generator for a draft `method`, or for none (None, and no `drafter`: plain decoding): a
    speculative one with its drafter (`drafter`, already loaded, else `load_drafter`'s from `model_path`,
    `heads`, `num_heads` and `seed`), its tree (`auto`, a spec or a `Tree`; None for the method's
    default), its draft vocabulary (a `--draft-vocab` value; `greedy` says which `auto` means) and its
    pacing (a `--step-cost` value), as `plan_tree` plans them; `buckets` are the prompt lengths it
    pads to and `loop_chunk` the decoding steps per chunk of its loop (`Generator`; `chunks.chunked`).
    Where the plan is None (tree `auto` with heads no chain of which pays here) it is a plain generator:
    drafting would only slow it."""
    if max_len is not None and max_len < 2:
        raise CloverError(f"max_len={max_len} must be >= 2 (a prompt token plus a new one)", arguments=("max_len",))
    if method is not None or drafter is not None:  # loaded here: a speculative generator drafts with it
        drafter = _drafter_for(model, method, drafter, model_path=model_path, heads=heads, num_heads=num_heads,
                               seed=seed)
    plan = plan_drafting(model, None, drafter=drafter, tree=tree, mesh=mesh, draft_vocab=draft_vocab, greedy=greedy,
                         step_cost=step_cost)
    if plan is None:
        return Generator(model, max_len=max_len, mesh=mesh, buckets=buckets, loop_chunk=loop_chunk)
    return SpeculativeGenerator(model, drafter.drafter, plan.tree, max_len=max_len, buckets=buckets, mesh=mesh,
                                draft_vocab=plan.draft_vocab, step_cost=plan.step_cost, loop_chunk=loop_chunk)
