"""The Python API: a model, its drafter, a generator and text out, in a few lines.

    import clover_jax

    model = clover_jax.load("smollm2")                 # or a checkpoint directory, a .gguf file, a Hub id;
                                                       # None: the shipped reference model
    gen = model.generator("clover2", temperature=0.7)  # the Clover-2 heads shipped beside the model
    out = gen.generate(["What is a KV cache?"], max_new_tokens=64, chat=True)
    print(out.texts[0], out.tau, out.tokens_per_second, out.finish_reasons)

It builds what `python -m infer.generate` builds, through the same factory (`plan.factory`) and
engine (`engine.decode.Generator`, `engine.speculative.SpeculativeGenerator`): a method, tree, draft
vocabulary or sampling setting means what the command's flag of that name means, and greedy output
is the command's, token for token. A user error is a `CloverError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.engine.chunks import DEFAULT_LOOP_CHUNK
from clover_jax.engine.decode import BUCKETS, GenerationOutput, Generator
from clover_jax.engine.sampling import SamplingConfig
from clover_jax.errors import CloverError
from clover_jax.io import sources, tokenization
from clover_jax.io.hf import load_pretrained
from clover_jax.model.config import ModelConfig
from clover_jax.model.llama import Llama
from clover_jax.model.sharding import make_mesh
from clover_jax.plan import factory
from clover_jax.plan.factory import LoadedDrafter

# The dtypes weights and activations run in, by the names `load` and the tools' --dtype take.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def finish_reason(tokens: list[int], eos_ids) -> str:
    """Why an answer ended: "eos" (its last token ends generation) or "length" (it ran to its budget)."""
    return "eos" if tokens and tokens[-1] in eos_ids else "length"


def load(model: str | Path | None = None, *, dtype="float32", mesh=None, chat_template: str | None = None) -> Model:
    """Load a base model and its tokenizer.

    model: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), a `.gguf`
      file, a Hub id such as "org/name", a named model ("smollm2"), or None for the shipped reference
      model (see `io.sources.model_dir`; a .gguf or named model is converted once into the cache).
    dtype: "float32" or "bfloat16" (a key of DTYPES), or a jnp dtype.
    mesh: a `jax.sharding.Mesh`, or a `--mesh` spec such as "model=4" or {"data": 2}: the weights are
      read straight into their shards; None: one device.
    chat_template: a Jinja chat template's text, in place of the tokenizer's own.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CloverError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    path = sources.model_dir(model)
    tokenizer = tokenization.load_tokenizer(path, chat_template)  # before the weights: a bad one fails fast
    if isinstance(mesh, (str, dict)):
        mesh = make_mesh(mesh)
    config, module = load_pretrained(path, dtype=dtype, mesh=mesh)
    return Model(module=module, path=path, config=config, tokenizer=tokenizer,
                 eos_ids=tokenization.eos_ids(path, config, tokenizer), source=model, mesh=mesh)


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded base model and what text in and out needs (`load` makes one)."""

    module: Llama = dataclasses.field(repr=False)  # the Flax NNX model (Llama, Mistral, Qwen2 load into it)
    path: Path  # its checkpoint directory
    config: ModelConfig = dataclasses.field(repr=False)
    tokenizer: object = dataclasses.field(repr=False)  # the checkpoint's `transformers` tokenizer
    eos_ids: tuple[int, ...]  # every id that ends generation (config's, generation_config's, tokenizer's)
    source: str | Path | None = None  # what `load` was given: shipped heads are looked for by it
    mesh: jax.sharding.Mesh | None = None

    def encode(self, prompt, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of one prompt: a string (with `chat`, the user turn of the chat template, after a
        `system` turn when given, ending with the assistant's opening), a conversation (a list of
        {"role", "content"} messages, rendered by the chat template with the assistant's opening), or
        token ids, taken as they are."""
        if isinstance(prompt, str):
            return tokenization.encode(self.tokenizer, prompt, chat=chat, bos_id=self.config.bos_token_id,
                                       system=system)
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], Mapping):
            if system is not None:
                raise CloverError("a conversation carries its own system turn: make it the first message")
            text = tokenization.render_chat(self.tokenizer, prompt, add_generation_prompt=True)
            return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        return [int(i) for i in prompt]

    def decode(self, tokens) -> str:
        """The text of token ids, special tokens left out (as the answers are printed)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def drafter(self, method: str, heads: str | Path | None = "shipped", *, num_heads: int | None = None,
                seed: int = 0) -> LoadedDrafter:
        """The drafter of `method` ("medusa", "clover", "clover2", "eagle", "eagle3"): the heads shipped
        beside the model ("shipped" or None), a heads directory written by `train.train`, or "random"
        (untrained: `num_heads` of them, default the method's depth, initialised with `seed`). Load it
        once and hand it to several generators (`generator(heads=...)`)."""
        return factory.load_drafter(self.module, method, model_path=self.source, model_dir=self.path, heads=heads,
                                    num_heads=num_heads, seed=seed)

    def generator(self, method: str | None = None, *, heads: str | Path | LoadedDrafter | None = "shipped",
                  tree="auto", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  draft_temperature: float = 1.0, draft_vocab: str | int | None = "auto",
                  step_cost: str | float | None = "auto", max_len: int | None = None,
                  buckets=BUCKETS, loop_chunk: int = DEFAULT_LOOP_CHUNK) -> TextGenerator:
        """A generator: plain decoding (no `method`, the default; "plain", the command line's word for it,
        means the same) or speculative decoding with a draft method's `heads` (what `drafter` takes, or a
        drafter it returned, whose method is then the default). Each setting is `infer.generate`'s flag
        of the same name: `tree` a `--tree` spec ("auto", "default", "chain:3", "dynamic:32", ...) or a `Tree`; `temperature` (0: greedy),
        `top_p`, `top_k` and `draft_temperature` the sampling; `draft_vocab` the tokens drafted from
        (`--draft-vocab`: "auto", N, 0 for all); `step_cost` the pacing (`--step-cost`: "auto", "none",
        a number); `max_len` the KV cache positions (default: the model's max_position_embeddings);
        `buckets` the prompt lengths compiled for; `loop_chunk` the decoding steps per chunk of the
        loop (`--loop-chunk`: the tokens are the same for every value, the speed may differ). Tree "auto" with heads no chain of which pays on this
        machine gives plain decoding (`TextGenerator.speculative` says which)."""
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                                  draft_temperature=draft_temperature)
        if method == "plain":
            method = None
        if isinstance(heads, LoadedDrafter):
            method, drafter = method or heads.method, heads
        else:
            drafter = None if method is None else self.drafter(method, heads)
        engine = factory.make_generator(self.module, method, drafter=drafter, tree=tree, max_len=max_len,
                                        mesh=self.mesh, draft_vocab=draft_vocab, greedy=sampling.greedy,
                                        buckets=buckets, step_cost=step_cost, loop_chunk=loop_chunk)
        return TextGenerator(model=self, engine=engine, method=method, sampling=sampling)


def _as_batch(prompts) -> list:
    """A list of prompts from one prompt (a string, token ids, a conversation) or a list of them."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], (Mapping, int, np.integer)):
        return [prompts]
    if not prompts:
        raise CloverError("no prompts given")
    return prompts


@dataclasses.dataclass(eq=False)
class TextGenerator:
    """Text in, text out over one engine (`Model.generator` makes one; it compiles once per batch size
    and prompt-length bucket, so keep it for further calls)."""

    model: Model = dataclasses.field(repr=False)
    engine: Generator = dataclasses.field(repr=False)  # a `Generator`, or a `SpeculativeGenerator` when drafting
    method: str | None  # the draft method it was asked to draft with; None: plain decoding
    sampling: SamplingConfig

    @property
    def speculative(self) -> bool:
        """Whether it drafts (tree "auto" may have picked plain decoding for this machine)."""
        return self.engine.tree is not None

    @property
    def tree(self):
        """The draft tree (a `Tree` or `DynamicTree`), or None for plain decoding."""
        return self.engine.tree

    @property
    def draft_vocab(self):
        """The drafter's `DraftVocab` (None: the whole vocabulary, or no drafting)."""
        return self.engine.draft_vocab

    @property
    def max_len(self) -> int:
        """KV cache positions: a prompt and its new tokens must fit."""
        return self.engine.max_len

    def generate(self, prompts, max_new_tokens: int = 128, *, chat: bool = False, system: str | None = None,
                 seed: int = 0, stop_at_eos: bool = True, batch_size: int | None = None,
                 on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None) -> Generation:
        """Generate up to `max_new_tokens` for each prompt.

        prompts: one prompt or a list of them, each a string, token ids or a conversation (`Model.encode`;
          `chat` and `system` apply to the strings).
        seed: the sampling seed (batch k takes seed + k, as the command's batches do).
        stop_at_eos: end each answer at the model's EOS ids; False: always write `max_new_tokens`.
        batch_size: prompts generated together; each batch is filled to it, so that all share one
          compiled program (default: every prompt in one batch).
        on_tokens: called after each decoding step with (tokens [B, M], counts [B]) of the batch so
          far, to show text as it is written (`clover_jax.StreamPrinter` prints the first sequence's).
        """
        ids = [self.model.encode(p, chat=chat, system=system) for p in _as_batch(prompts)]
        size = len(ids) if batch_size is None else batch_size
        if size < 1:
            raise CloverError(f"batch_size={size} must be >= 1")
        eos = self.model.eos_ids if stop_at_eos else ()
        outputs = []
        for k, start in enumerate(range(0, len(ids), size)):
            out = self.engine.generate(ids[start:start + size], max_new_tokens, sampling=self.sampling, seed=seed + k,
                                       eos_ids=eos, on_tokens=on_tokens, batch_size=size)
            out.state = None  # the final device state holds the batch's KV cache, which nothing here reads
            outputs.append(out)
        tokens = [t for out in outputs for t in out.tokens]
        return Generation(texts=[self.model.decode(t) for t in tokens], tokens=tokens,
                          finish_reasons=[finish_reason(t, eos) for t in tokens],
                          steps=[s for out in outputs for s in out.sequence_steps], outputs=outputs)


@dataclasses.dataclass
class Generation:
    """What `TextGenerator.generate` wrote, per prompt in order, and what it took."""

    texts: list[str]  # the new text (special tokens left out)
    tokens: list[list[int]]  # the new token ids (the EOS id included when one ended the answer)
    finish_reasons: list[str]  # "eos" (an EOS id ended it) or "length" (it ran to max_new_tokens)
    steps: list[int]  # the base model's forward passes for it, the prefill included
    outputs: list[GenerationOutput] = dataclasses.field(repr=False)  # the engine's, one per batch

    @property
    def text(self) -> str:
        """The text of the one prompt given."""
        if len(self.texts) != 1:
            raise CloverError(f"{len(self.texts)} prompts were given: read .texts")
        return self.texts[0]

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tau(self) -> float:
        """Tokens per forward pass of the base model (bonus token included; plain decoding: 1.0)."""
        return self.num_new_tokens / max(sum(self.steps), 1)

    @property
    def run_seconds(self) -> float:
        """Time generating, compiling left out."""
        return sum(out.run_seconds for out in self.outputs)

    @property
    def compile_seconds(self) -> float:
        """Time compiling programs this call needed first (0 when all were compiled already)."""
        return sum(out.compile_seconds for out in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / max(self.run_seconds, 1e-9)

    @property
    def accept_hist(self) -> np.ndarray | None:
        """[B, D+1] per prompt, the speculative steps that accepted d drafted tokens; None when plain."""
        hists = [out.accept_hist for out in self.outputs]
        return None if any(h is None for h in hists) else np.concatenate(hists)
