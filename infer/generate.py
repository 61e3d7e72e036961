"""Generate text with a Llama-family model from the command line.

    python -m infer.generate --prompt "def fibonacci(n):"

The generated text (prompt excluded) goes to stdout, one statistics line to stderr. A user error
(bad checkpoint, prompt too long, bad sampling setting) prints one `error:` line and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from clover_jax import (DTYPES, METHODS, CloverError, Generator, ModelConfig, SamplingConfig, finish_reason,
                        load_pretrained, make_generator)
from clover_jax import _cli as cli
from clover_jax.drafters import HEADS
from clover_jax.drafters import registry
from clover_jax.io import sources, tokenization
from clover_jax.model.sharding import describe_mesh
from clover_jax._cli.conversation import answer_turns, record_turns
from clover_jax._cli.stream import StreamPrinter
from infer.loop_flags import add_loop_chunk, check_loop_chunk

# --method's word for decoding with no drafter (the library's None), as the statistics line names it.
PLAIN = "plain"

EPILOG = """\
examples:
  python -m infer.generate --prompt "def fibonacci(n):"
  python -m infer.generate --method clover2 --prompt "def fibonacci(n):"
  python -m infer.generate --method medusa --heads random --tree chain:3 --prompt "import os"
  python -m infer.generate --prompt "import os" --temperature 0.8 --top-p 0.95 --seed 1
  python -m infer.generate --model path/to/llama --chat --stream --prompt "What is a KV cache?"
  python -m infer.generate --prompts question.jsonl --batch-size 4 --json > answers.jsonl
  python -m infer.generate --model path/to/llama --method clover2 --heads heads/clover2 --interactive

A prompts file holds one JSON object per line: {"prompt": ...}, Spec-Bench's {"turns": [...]}
(the first turn is used) or ShareGPT's {"conversations": [...]} (the first human turn); a ShareGPT
JSON array is read too. With --chat, a record's own system turn (ShareGPT's, or a top-level "system")
comes before its prompt; --system stands in for it in records without one.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer.generate",
        description="Generate text with a Llama-family model (a Hugging Face checkpoint directory) in JAX.\n"
                    "Prints the generated text (prompt excluded) on stdout, one statistics line on stderr.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="DIR",
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files) "
                        f"(default: the shipped reference model, {sources.DEFAULT_MODEL_DIR})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one prompt, as text")
    src.add_argument("--prompts", metavar="FILE",
                     help="JSONL file of prompts (- reads standard input): {\"prompt\"}, Spec-Bench {\"turns\"} "
                          "or ShareGPT {\"conversations\"} records (see below)")
    src.add_argument("--interactive", action="store_true",
                     help="chat on the terminal: each line typed is a user turn (implies --chat), the reply is "
                          "printed as it is written, and the conversation so far is the next prompt (its oldest "
                          "exchanges dropped when it no longer fits --max-len); Ctrl-D ends it")
    cli.add_chat_flags(p)
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="with --prompts and --chat: answer each record's first user turn (first), or every user "
                        "turn in turn, each after the conversation so far with the model's own earlier answers, "
                        "as FastChat answers MT-Bench (all: Spec-Bench's two turns, ShareGPT's human turns; a "
                        "conversation ends at an answer cut short by --max-new-tokens or that leaves no room in "
                        "--max-len; with --json each object also gives record and turn, from 1) (default: "
                        "%(default)s)")
    p.add_argument("--method", choices=(PLAIN,) + METHODS, default=PLAIN,
                   help="decoding method: plain (one token per forward pass) or speculative decoding with a "
                        "draft method's drafter: draft heads (medusa, clover, clover2), a draft model (eagle, "
                        "eagle3) or a block drafter (dflash, dflash2) (default: %(default)s)")
    p.add_argument("--drafter", "--heads", dest="heads", metavar="DIR",
                   help="the drafter (draft heads or a draft model): a directory written by train.train, a "
                        "published drafter's folder or Hub id, or 'random' for an untrained one; --heads is "
                        "the same flag, by its older name (default: MODEL/heads/METHOD, the drafter shipped "
                        "beside the model)")
    p.add_argument("--tree", metavar="SPEC", default="auto",
                   help="draft tree: a static one - default (the tree fitted to the heads, their tree.json, "
                        "else the method's paper tree; on a GPU or TPU, EAGLE-1's and EAGLE-3's own dynamic "
                        "trees, eagle2:60,10,5 and eagle2:60,10,7), fitted (the heads' tree.json), paper (the "
                        "method's paper tree; also mc_sim_7b_63), "
                        "chain:D, full:WxD, widths:W1,W2,..., a JSON list of paths such as [[0],[1],[0,0]], or a "
                        "JSON file of one - or a dynamic one chosen per step from the heads' probabilities under "
                        "a budget of N nodes: dynamic:N (Clover's sampler; ',W' after N sets the beam width) or "
                        "eagle2:N,K,D (EAGLE-2's tree as its authors draft it: the global top N-1 of every child "
                        "of a beam of K nodes per depth, K children each, D depths after the root's; left out, "
                        "60, 10, 7). auto: the default tree on a GPU or TPU; on a CPU, where each "
                        "verified token costs compute, a chain as deep as the heads' held-out chain tau (in "
                        "heads.json) says is fastest for what a chain step costs on this machine (timed once and "
                        "kept, see --step-cost), or no drafting at all where no chain beats plain decoding; through "
                        "every head for heads without the record (default: %(default)s)")
    p.add_argument("--draft-vocab", default="auto", metavar="N",
                   help="tokens the heads draft from: the N most frequent in the heads' training data (counted "
                        "at export; when sampling, the N most probable under the base model there), which cuts "
                        "the lm_head read of every draft level to N/V of it and changes no output; 0: the whole "
                        "vocabulary; auto: the tokens making up 99.9%% of the counts when greedy, 99%% of the "
                        "probability mass when sampling (the whole vocabulary for heads exported without it) "
                        "(default: %(default)s)")
    p.add_argument("--step-cost", default="auto", metavar="C",
                   help="pace the drafting by what a speculative step costs, in plain steps: while the drafts "
                        "accepted lately (a running mean) do not pay for C, take plain steps (no drafting), with a "
                        "speculative step after 8 to see whether drafts pay again (after 16, 32, up to 64 while they "
                        "do not); the text is the same "
                        "(greedy) or keeps its distribution (sampling). auto: on a CPU, what a step of the chain "
                        "--tree auto picks costs there, timed on this machine the first time (a plain step and chain "
                        "steps, greedy or sampling: a minute or two for SmolLM2) and kept in step-costs.json in the cache folder "
                        "($CLOVER_JAX_STEP_COSTS: another file, or off for the fitted 1.15 + 0.14 per draft, 0.10 "
                        "more when sampling); no pacing on a GPU or TPU, where a tree step costs about one plain "
                        "step, or for any other --tree; none: draft at every step (default: %(default)s)")
    p.add_argument("--num-heads", type=cli.at_least(1), metavar="K",
                   help="number of heads with --heads random (default: " + ", ".join(f"{m} {registry.get(m).depth}" for m in HEADS) + ")")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="most tokens to generate per prompt; generation also stops at EOS (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 means greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this mass; 1 turns it off "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="keep only the K most likely tokens; 0 turns it off (default: %(default)s)")
    p.add_argument("--draft-temperature", type=float, default=1.0, metavar="X",
                   help="when sampling, draw the drafts from the heads' logits at --temperature times X: the "
                        "output's distribution stays the base model's whatever X; X only moves how often drafts "
                        "are kept (default: %(default)s)")
    p.add_argument("--seed", type=cli.seed, default=0, metavar="S",
                   help="random seed for sampling, 0 to 2**32-1; batch i of --prompts uses S+i, reply i of "
                        "--interactive (S+i) mod 2**32 (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype of weights and activations (default: %(default)s)")
    p.add_argument("--max-len", type=int, metavar="N",
                   help="KV cache positions: prompt plus new tokens must fit "
                        "(default: the model's max_position_embeddings)")
    add_loop_chunk(p)
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="prompts of --prompts generated together in one batch; a last, smaller batch is filled "
                        "to this size, so it needs no program of its own (default: 8; 1 with --stream)")
    cli.add_mesh_flags(p, "the engine", "; sizes that multiply to fewer devices than there are take the first "
                       "ones (the statistics line says how many); a batch is filled to a multiple of data x fsdp")
    cli.add_compile_cache_flag(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, tokens, num_tokens, finish_reason: eos "
                        "or length, steps: the base model's forward passes for it, tau) instead of text separated "
                        "by '---' lines")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is written, step by step, one prompt at a time (not with --json, "
                        "a --batch-size over 1 or several processes); each step then waits for a copy of its "
                        "tokens to this host, which tokens/s includes")
    return p


class Tally:
    """What the statistics line reports, summed over generate calls."""

    def __init__(self):
        self.new_tokens = self.steps = self.seq_steps = self.decode_steps = self.drafted = 0
        self.compile_s = self.run_s = 0.0

    def add(self, out) -> None:
        """Count a generate call's rows (its real ones: `Generator.generate` returns no filler)."""
        self.new_tokens += sum(len(t) for t in out.tokens)
        self.steps += out.steps
        self.seq_steps += sum(out.sequence_steps)
        self.decode_steps += out.decode_steps
        self.drafted += out.drafted_steps
        self.compile_s += out.compile_seconds
        self.run_s += out.run_seconds

    def line(self, method: str, generator: Generator) -> str:
        tau = self.new_tokens / max(self.seq_steps, 1)
        tree = generator.tree
        shape = "" if tree is None else f" tree={tree.num_nodes} nodes, depth {tree.max_depth}"
        if tree is None and method != PLAIN:
            shape = " plain decoding (tree auto: no chain of these heads is modelled to beat it here)"
        if tree is not None:
            vocab = generator.draft_vocab
            shape += f", drafting from {'all' if vocab is None else vocab.size} tokens"
            if generator.step_cost is not None:  # paced: how many of the steps after the prefills drafted
                shape += (f", paced at {generator.step_cost:g} plain steps: drafted in "
                          f"{self.drafted}/{self.decode_steps} steps")
        if generator.mesh is not None:
            shape += f" mesh {describe_mesh(generator.mesh)}"
        return (f"[{method}]{shape} new_tokens={self.new_tokens} steps={self.steps} tau={tau:.2f} "
                f"tokens/s={self.new_tokens / max(self.run_s, 1e-9):.1f} compile={self.compile_s:.2f}s "
                f"run={self.run_s:.2f}s")


def converse(generator: Generator, tokenizer, lines, *, system: str | None, max_new_tokens: int,
             sampling: SamplingConfig, seed: int, eos: tuple[int, ...], method: str, ask: bool = False) -> Tally:
    """A chat: each line read from `lines` is a user turn; the reply to it is streamed to stdout (and its
    statistics line to stderr), and the conversation so far, rendered by the chat template, is the next
    prompt. When it no longer leaves --max-new-tokens of room in the cache, its oldest exchanges go
    (the system turn stays); a turn that fits not even alone is refused in one line, and the chat goes on.
    Reply k samples with seed + k (mod 2**32: a chat has no end known up front)."""
    tally = Tally()
    exchanges: list[tuple[str, str]] = []
    replies = 0
    while True:
        if ask:
            print("> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line:
            if ask:
                print(file=sys.stderr)  # Ctrl-D left the cursor after the prompt
            return tally
        user = line.rstrip("\r\n")
        if not user.strip():
            continue
        while True:
            text = tokenization.render_chat(tokenizer, tokenization.chat_messages(exchanges, user, system), add_generation_prompt=True)
            ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
            if len(ids) + max_new_tokens <= generator.max_len or not exchanges:
                break
            exchanges.pop(0)
            print("(the oldest exchange no longer fits --max-len: dropped)", file=sys.stderr)
        room = generator.max_len - len(ids)
        if room < 1:
            print(f"error: this turn alone is {len(ids)} tokens, leaving no room for a reply in --max-len "
                  f"{generator.max_len}; say it in fewer words or raise --max-len", file=sys.stderr)
            continue
        printer = StreamPrinter(tokenizer)
        out = generator.generate([ids], min(max_new_tokens, room), sampling=sampling,
                                 seed=(seed + replies) % cli.SEEDS, eos_ids=eos, on_tokens=printer)
        replies += 1
        [tokens] = out.tokens
        printer.show(tokens, final=True)
        print(flush=True)
        tally.add(out)
        reply = Tally()
        reply.add(out)
        print(reply.line(method, generator), file=sys.stderr)
        exchanges.append((user, tokenizer.decode(tokens[:-1] if tokens[-1:] and tokens[-1] in eos else tokens,
                                                 skip_special_tokens=True)))


def answer_line(tokenizer, prompt: str, tokens: list[int], steps: int, eos: tuple[int, ...], as_json: bool,
                **fields) -> str:
    """One answer as it is printed: its text, or with --json its object (`fields` after the prompt)."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not as_json:
        return text
    return json.dumps({"prompt": prompt, **fields, "text": text, "tokens": tokens, "num_tokens": len(tokens),
                       "finish_reason": finish_reason(tokens, eos), "steps": steps,
                       "tau": round(len(tokens) / max(steps, 1), 4)}, ensure_ascii=False)


def answer_every_turn(generator: Generator, tokenizer, records, texts, prompts: list[list[int]], *,
                      system: str | None, batch_size: int, max_new_tokens: int, sampling: SamplingConfig, seed: int,
                      eos: tuple[int, ...], tally: Tally) -> list[list[tuple[str, list[int], int]]]:
    """--turns all: each record's user turns answered in turn, each after the conversation so far with the
    model's own earlier answers, as FastChat's gen_model_answer answers MT-Bench (`answer_turns`). Per
    record, (user turn, answer, forward passes) of each turn answered; batch k takes seed + k over all
    the turns."""
    users = [record_turns(record, where)[0] for record, where in records]
    systems = [cli.prompt_system(own, True, system) for _, own in texts]
    steps_by_turn: list[list[int]] = []  # per turn, per conversation asked it (in order)
    batches = 0

    def answer(batch: list[list[int]], turn: int) -> list[list[int]]:
        nonlocal batches
        replies, steps = [], []
        size = min(batch_size, len(batch))
        for group in cli.batches(batch, size):
            out = generator.generate(group, max_new_tokens, sampling=sampling, seed=seed + batches, eos_ids=eos,
                                     batch_size=size)
            batches += 1
            tally.add(out)
            replies += out.tokens
            steps += out.sequence_steps
        steps_by_turn.append(steps)
        return replies

    turns = answer_turns(answer, tokenizer, users, systems, prompts, eos, generator.max_len - max_new_tokens + 1,
                         [where for _, where in records])
    # Turn t was asked of the conversations that reached it, in order: conversation i is the one after
    # as many earlier ones as reached it too.
    return [[(users[i][t], reply, steps_by_turn[t][sum(len(turns[j]) > t for j in range(i))])
             for t, (_, _, reply) in enumerate(conversation)] for i, conversation in enumerate(turns)]


def _generate(args: argparse.Namespace) -> int:
    cli.use_compile_cache(args.compile_cache)
    if args.interactive or args.stream:  # both print one sequence's text as it is written
        fix = ("drop --json" if args.json else
               f"drop --batch-size {args.batch_size}" if args.batch_size not in (None, 1) else None)
        if fix:
            what = "--interactive is a chat, one reply" if args.interactive else "--stream prints one prompt"
            raise CloverError(f"{what} at a time, as text: {fix}")
    args.chat = args.chat or args.interactive
    if args.turns == "all" and (args.prompts is None or args.stream or not args.chat):
        raise CloverError("--turns all answers the turns of --prompts records in turn, through the chat template: "
                          + ("give --prompts" if args.prompts is None else "drop --stream" if args.stream else
                             "add --chat"))
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              draft_temperature=args.draft_temperature)
    path = sources.model_dir(args.model)
    cfg = ModelConfig.from_pretrained(path)
    tokenizer = cli.load_tokenizer(path, cli.chat_template_flag(args.chat, args.chat_template, args.model))
    if args.interactive:
        tokenization.render_chat(tokenizer, tokenization.chat_messages([], "", args.system))  # no chat template: one line, before loading
        texts = []
    else:
        records = [] if args.prompt is not None else cli.read_records(args.prompts)
        texts = [(args.prompt, None)] if args.prompt is not None else cli.prompt_turns(records)
    prompts = cli.encode_prompts(tokenizer, texts, args.chat, args.system, cfg.bos_token_id)
    eos = tokenization.eos_ids(path, cfg, tokenizer)
    size = args.batch_size if args.batch_size is not None else 1 if args.stream else 8
    size = min(size, max(len(prompts), 1))
    groups = cli.batches(list(range(len(prompts))), size)
    # --turns all: each turn's batches at most as many as the first's
    turns = max((len(record_turns(r, where)[0]) for r, where in records), default=1) if args.turns == "all" else 1
    cli.check_seeds(args.seed, len(groups) * turns)

    mesh = cli.mesh_of(args)
    _, model = load_pretrained(path, dtype=DTYPES[args.dtype], mesh=mesh)
    drafted = None if args.method == PLAIN else args.method  # plain decoding: no drafter
    generator = make_generator(model, drafted, model_path=args.model, heads=args.heads, tree=args.tree,
                               num_heads=args.num_heads, max_len=args.max_len, seed=args.seed, mesh=mesh,
                               draft_vocab=args.draft_vocab, greedy=sampling.greedy, step_cost=args.step_cost,
                               loop_chunk=check_loop_chunk(args))
    if args.interactive:
        if sys.stdin.isatty():
            print("chat: type a message and press Enter; Ctrl-D ends", file=sys.stderr)
        tally = converse(generator, tokenizer, sys.stdin, system=args.system, max_new_tokens=args.max_new_tokens,
                         sampling=sampling, seed=args.seed, eos=eos, method=args.method, ask=sys.stdin.isatty())
        print(tally.line(args.method, generator), file=sys.stderr)
        return 0
    tally = Tally()
    if args.turns == "all":
        answers = answer_every_turn(generator, tokenizer, records, texts, prompts, system=args.system,
                                    batch_size=size, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                    seed=args.seed, eos=eos, tally=tally)
        lines = [answer_line(tokenizer, user, tokens, steps, eos, args.json, record=i + 1, turn=t + 1)
                 for i, conversation in enumerate(answers) for t, (user, tokens, steps) in enumerate(conversation)]
        print(("\n" if args.json else "\n---\n").join(lines))
        print(tally.line(args.method, generator), file=sys.stderr)
        return 0
    # Progress on the terminal while the answers go to a file (--prompts ... > answers.jsonl); on the
    # terminal the answers themselves show it.
    bar = tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr, leave=False, dynamic_ncols=True,
               disable=len(groups) < 2 or sys.stdout.isatty() or not sys.stderr.isatty())
    for k, group in enumerate(groups):
        printer = None
        if args.stream:
            if group[0]:
                print("---", flush=True)
            printer = StreamPrinter(tokenizer)
        out = generator.generate([prompts[i] for i in group], args.max_new_tokens, sampling=sampling,
                                 seed=args.seed + k, eos_ids=eos, on_tokens=printer, batch_size=size)
        tally.add(out)
        for i, tokens, steps in zip(group, out.tokens, out.sequence_steps):
            if printer:  # the text is on the screen already, but for what the last step left held back
                printer.show(tokens, final=True)
                print()
                continue
            if i and not args.json:
                print("---")
            print(answer_line(tokenizer, texts[i][0], tokens, steps, eos, args.json))
        sys.stdout.flush()
        bar.update(len(group))
    bar.close()
    print(tally.line(args.method, generator), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: _generate(args))


if __name__ == "__main__":
    cli.exit(main())
