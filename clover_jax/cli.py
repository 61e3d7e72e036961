"""What the command-line tools share: the default model, prompt files, tokenizing, EOS ids, output
folders, exit codes, common flags.

`infer.generate`, the benchmark and the training tools (`train.make_data`, `train.train`) read the same
prompt files and turn text into ids the same way, so it lives in the library, which the tools of both
`infer/` and `train/` import; neither tool package imports the other. Everything a user can get wrong becomes a `CloverError`; `run_main` turns it into one
`error: ...` line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from clover_jax import sources
from clover_jax.config import ModelConfig
from clover_jax.errors import CloverError

# The tools use transformers for tokenizers and chat templates only, never its torch models: its advice,
# printed at import where torch is missing (as it is for users of the tools), is noise on every run.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The shipped reference model, found from this file so the tools work from any directory.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "reference"


def model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory to use (`None`: the reference model): a directory, a .gguf file, a Hub id or
    a named model such as smollm2 (`sources.model_path`); one that cannot be found is one error line."""
    if path is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise CloverError(f"the reference model is not at {DEFAULT_MODEL_DIR}; "
                              "pass --model DIR with a Hugging Face checkpoint directory")
        return DEFAULT_MODEL_DIR
    return sources.model_path(path)


def heads_root(model: str | Path | None, path: Path) -> Path:
    """Where the heads trained for a model live: models/NAME/heads in this repository for a named model,
    else beside the checkpoint (`path`, its directory)."""
    return (sources.shipped_dir(model) or path) / "heads"


def first_prompt(record, where: str) -> str:
    """The prompt of one record: {"prompt"}, Spec-Bench {"turns"} (first turn) or ShareGPT
    {"conversations"} (first human turn)."""
    if isinstance(record, dict):
        if isinstance(record.get("prompt"), str):
            return record["prompt"]
        turns = record.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
        conv = record.get("conversations")
        if isinstance(conv, list):
            for turn in conv:
                if isinstance(turn, dict) and turn.get("from") in ("human", "user") \
                        and isinstance(turn.get("value"), str):
                    return turn["value"]
    raise CloverError(f"{where}: no prompt found; expected {{\"prompt\": ...}}, Spec-Bench {{\"turns\": [...]}} "
                      "or ShareGPT {\"conversations\": [{\"from\": \"human\", \"value\": ...}]}")


def read_records(path: str | Path) -> list[tuple[dict, str]]:
    """(record, where) for each record of a JSONL file (one per line) or a JSON array (ShareGPT's usual
    form), of standard input for "-", or of a named source (`sharegpt`, `mt-bench`: `sources.named_records`);
    `where` names the record ("file:line") in error messages."""
    if sources.is_named(path) and not Path(path).exists():
        if sources.is_named(path, "model"):
            raise CloverError(f"{path} is a model, not a prompts or data source; named ones: "
                              f"{', '.join(n for n, s in sources.SOURCES.items() if s.kind != 'model')}")
        return sources.named_records(str(path))
    stdin = str(path) == "-"
    name = "stdin" if stdin else str(path)
    try:
        text = sys.stdin.read() if stdin else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"{name}: cannot read the prompts file ({e.__class__.__name__}: {e})") from None
    if text.lstrip().startswith("["):
        try:
            records = [(r, f"{name}: record {i + 1}") for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise CloverError(f"{name}: not valid JSON ({e})") from None
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((json.loads(line), f"{name}:{n}"))
                except json.JSONDecodeError as e:
                    raise CloverError(f"{name}:{n}: not a JSON object ({e})") from None
    if not records:
        raise CloverError(f"{name}: no prompts in the file")
    return records


def record_system(record) -> str | None:
    """A record's own system turn: a top-level "system" string, or a ShareGPT {"from": "system"} turn."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("system"), str):
        return record["system"]
    conv = record.get("conversations")
    for turn in conv if isinstance(conv, list) else ():
        if isinstance(turn, dict) and turn.get("from") == "system" and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def prompt_turns(records: list[tuple[dict, str]]) -> list[tuple[str, str | None]]:
    """(text, the record's own system turn or None) per (record, where) of `read_records`."""
    return [(first_prompt(record, where), record_system(record)) for record, where in records]


def read_prompt_turns(path: str | Path) -> list[tuple[str, str | None]]:
    """`prompt_turns` of a prompts file (see `read_records`, and `first_prompt` for the record formats)."""
    return prompt_turns(read_records(path))


def read_prompts(path: str | Path) -> list[str]:
    """The prompt texts of a prompts file (`read_prompt_turns` without the system turns)."""
    return [text for text, _ in read_prompt_turns(path)]


def prompt_system(own: str | None, chat: bool, system: str | None) -> str | None:
    """The system turn a prompt is rendered with: under --chat its record's own when it has one (the
    conversation was written under it), else --system; without --chat there are no turns to keep."""
    return own if chat and own is not None else system


def encode_prompts(tokenizer, prompts: list[tuple[str, str | None]], chat: bool, system: str | None,
                   bos_id: int | None) -> list[list[int]]:
    """Token ids of `read_prompt_turns`' (text, own system) pairs under --chat and --system (`encode`)."""
    return [encode(tokenizer, text, chat=chat, bos_id=bos_id, system=prompt_system(own, chat, system))
            for text, own in prompts]


def load_tokenizer(path: Path, chat_template: str | None = None):
    """`AutoTokenizer` from a local directory: no hub look-up, never `trust_remote_code`; with
    `chat_template` (--chat-template: a name of `CHAT_TEMPLATES` or a Jinja file), that template in place
    of the tokenizer's own."""
    from transformers import AutoTokenizer  # slow import; only the tools need it

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise CloverError(f"{path}: cannot load a tokenizer ({first})") from None
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


# Chat templates for models whose tokenizer ships none. vicuna: FastChat's vicuna_v1.1 conversation, the
# format Vicuna was trained on and Medusa, EAGLE and Spec-Bench prompt it with ("SYSTEM USER: q
# ASSISTANT: a</s>USER: q2 ASSISTANT:"); a system turn replaces FastChat's default system message.
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
CHAT_TEMPLATES = {
    "vicuna": ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
               "{% set turns = messages[1:] %}{% else %}" + VICUNA_SYSTEM + "{% set turns = messages %}{% endif %}"
               "{% for m in turns %}{% if m['role'] == 'user' %}{{ ' ' if loop.first else '' }}USER: "
               "{{ m['content'] }} ASSISTANT:{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
}


def read_chat_template(spec: str) -> str:
    """--chat-template's Jinja text: a name of `CHAT_TEMPLATES`, or a file holding a template."""
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    try:
        text = Path(spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CloverError(f"--chat-template {spec}: neither a template name ({', '.join(CHAT_TEMPLATES)}) nor a "
                          f"readable file ({e.__class__.__name__})") from None
    if not text.strip():
        raise CloverError(f"--chat-template {spec}: the file is empty")
    return text


def add_chat_flags(p, chat_help: str = "wrap each prompt as a user turn in the tokenizer's chat template, ending "
                                        "with the assistant's opening (what a chat model such as Llama-3-Instruct "
                                        "expects)") -> None:
    """--chat, --chat-template and --system: how a chat model (Vicuna, Llama-3-Instruct) is prompted."""
    p.add_argument("--chat", action="store_true", help=chat_help)
    p.add_argument("--chat-template", metavar="NAME|FILE",
                   help="with --chat: the chat template to use instead of the tokenizer's: vicuna (FastChat's "
                        "vicuna_v1.1, Vicuna's own format, which its tokenizer does not ship) or a Jinja file "
                        "(default: the tokenizer's)")
    p.add_argument("--system", metavar="TEXT",
                   help="with --chat: a system turn before each prompt whose record has none of its own (a "
                        "top-level \"system\" or a ShareGPT system turn, which is kept) (default: none, the "
                        "template's own)")


def chat_template_flag(chat: bool, chat_template: str | None) -> str | None:
    """--chat-template, refused in one line without --chat (it is the template --chat renders with)."""
    if chat_template is not None and not chat:
        raise CloverError("--chat-template is the template --chat renders prompts with; add --chat")
    return chat_template


def chat_turns(text: str, system: str | None = None) -> list[dict]:
    """The messages a prompt becomes under --chat: a system turn when given, then the user's."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def chat_messages(exchanges, user: str, system: str | None = None) -> list[dict]:
    """The messages of a conversation's (user, reply) exchanges then a new user turn, the system turn
    (when given) first."""
    messages: list[dict] = []
    for said, reply in exchanges:
        messages += chat_turns(said, None if messages else system) + [{"role": "assistant", "content": reply}]
    return messages + chat_turns(user, None if messages else system)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The text of `messages` under the tokenizer's chat template, or one error line: no template, or
    the template's own refusal (jinja2's raise_exception, e.g. a system turn Mistral's will not take)."""
    if not getattr(tokenizer, "chat_template", None):
        raise CloverError("--chat: the tokenizer has no chat template; drop --chat or use a chat model's tokenizer")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template's own refusal
        hint = ("; it may take no system turn: drop --system, or the records' system turns"
                if any(m["role"] == "system" for m in messages) else "")
        raise CloverError(f"--chat: the tokenizer's chat template refused the prompt: {e}{hint}") from None


def check_system(chat: bool, system: str | None) -> None:
    """Refuse --system without --chat: a system turn is a turn of the chat template."""
    if system is not None and not chat:
        raise CloverError("--system is a turn of the chat template; add --chat")


def encode(tokenizer, text: str, chat: bool = False, bos_id: int | None = None,
           system: str | None = None) -> list[int]:
    """Token ids of a prompt, with the special tokens the tokenizer adds by default (Llama's BOS).

    With `chat`, the text is the user turn of the tokenizer's chat template (after a `system` turn
    when given), rendered with the assistant's opening; the template writes its own special tokens,
    so none are added on top. An empty prompt becomes [BOS] when there is one: the model needs at
    least one token.
    """
    check_system(chat, system)
    if chat:
        text = render_chat(tokenizer, chat_turns(text, system), add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos_id
        if bos is None:
            raise CloverError("the prompt is empty and the tokenizer has no BOS token to start from; give a prompt")
        ids = [int(bos)]
    return ids


def eos_ids(path: Path, cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: config.json's, generation_config.json's and the tokenizer's."""
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
            raise CloverError(f"{gen}: cannot be read as JSON ({e})") from None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(int(i) for i in ids))


def check_output_dir(path: str | Path, flag: str) -> None:
    """Refuse, in one line, a folder that a tool could not create or write into, at the start of its run
    rather than at the end of hours of work; nothing is created, so a run that fails later leaves no
    empty folder behind."""
    out = Path(path).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise CloverError(f"{flag}: cannot create the folder {path}: {existing} is a file; pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CloverError(f"{flag}: cannot write into {existing}; pick a writable path")


INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C, as a shell reports one


def run_main(body: Callable[[], int]) -> int:
    """Run a tool's body; a user error prints one `error:` line on stderr and returns 2, and Ctrl-C
    one `interrupted` line (no traceback) and returns 130. What the tools write is written whole or
    not at all (`clover_jax.files`), so an interrupted run leaves no half-written file."""
    try:
        return body()
    except (CloverError, OSError) as e:  # OSError: a file that vanished or cannot be read mid-run
        message = " ".join(str(e).split("\n"))
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED


def check_plot_format(out: str) -> None:
    """Refuse a --plot suffix matplotlib cannot write (no suffix means PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(out).suffix[1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise CloverError(f"--plot {out}: cannot write a .{suffix} image; end the name in one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")


def batches(items: Sequence, size: int) -> list[Sequence]:
    """`items` in consecutive chunks of at most `size`."""
    if size < 1:
        raise CloverError(f"--batch-size {size} must be >= 1")
    return [items[i:i + size] for i in range(0, len(items), size)]


COMPILE_CACHE_ENV = "CLOVER_JAX_COMPILE_CACHE"


def numbers(text: str, flag: str, parse, what: str, example: str, least: float) -> list:
    """Comma-separated numbers of a flag, each >= least, or one error line naming the flag."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CloverError(f"{flag} {text!r}: expected comma-separated {what} such as {example}") from None
    if not values or any(not v >= least for v in values):
        raise CloverError(f"{flag} {text!r}: give one or more {what} >= {least:g}")
    return values


def default_compile_cache() -> str:
    """$CLOVER_JAX_COMPILE_CACHE, else clover-jax/xla under the user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(COMPILE_CACHE_ENV) or os.path.join(base, "clover-jax", "xla")


def add_compile_cache_flag(p) -> None:
    """--compile-cache: where compiled programs are kept between runs (`use_compile_cache`)."""
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="folder where XLA keeps the compiled programs between runs, so that a later run of the same "
                        "shapes loads them instead of compiling again (the reference model's Clover-2 on the CPU: "
                        "4.5 s of compiling down to 1.6 s); off turns it off (default: $" + COMPILE_CACHE_ENV +
                        ", else ~/.cache/clover-jax/xla)")


def use_compile_cache(flag: str | None) -> None:
    """Point JAX's persistent compilation cache at --compile-cache's folder (before anything compiles:
    JAX looks once, at a process's first compilation). A folder given that cannot be written to is one
    error line; the default one is skipped quietly (a read-only home), as the cache only saves time."""
    folder = flag or default_compile_cache()
    if folder == "off":
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        if flag:
            raise CloverError(f"--compile-cache {folder}: cannot write there; give a writable folder, or off")
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(folder))


def add_distributed_flags(p) -> None:
    """Flags of a multi-process run (one process per host, or several on one machine)."""
    g = p.add_argument_group("multi-process (jax.distributed; also read from JAX's environment variables)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator service")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes taking part")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")


def init_distributed(args) -> None:
    """Start jax.distributed when the flags or JAX's environment (JAX_COORDINATOR_ADDRESS with
    JAX_NUM_PROCESSES and JAX_PROCESS_ID, or a cluster JAX detects itself) ask for it. On CPU the
    collectives go over gloo."""
    given = [f is not None for f in (args.coordinator, args.num_processes, args.process_id)]
    if not any(given) and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if any(given) and not all(given):
        raise CloverError("--coordinator, --num-processes and --process-id go together")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not any(given):
        jax.distributed.initialize()  # everything from the environment
    else:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def mesh_of(args):
    """The device mesh a command's --mesh asks for (None: one device), after joining the other
    processes when the flags or the environment name them."""
    init_distributed(args)
    if not args.mesh:
        return None
    from clover_jax.sharding import make_mesh

    return make_mesh(args.mesh)
