"""How a chat model is prompted from the command line: --chat, --chat-template (a named template or a
Jinja file) and --system."""

from __future__ import annotations

from pathlib import Path

from clover_jax.errors import CloverError
from clover_jax.io import sources, tokenization

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


def chat_template_flag(chat: bool, chat_template: str | None, model=None) -> str | None:
    """--chat-template, refused in one line without --chat (it is the template --chat renders with);
    --chat with a named base model (`model`: --model's value) and no template of its own is refused too."""
    if chat_template is not None and not chat:
        raise CloverError("--chat-template is the template --chat renders prompts with; add --chat")
    if chat and chat_template is None and sources.is_base_model(model):
        raise CloverError(f"--chat: {model} is a base model, not instruction-tuned, and has no chat template; drop "
                          "--chat (--interactive chats too) and give it plain text to continue")
    return chat_template


def load_tokenizer(path: Path, chat_template: str | None = None):
    """The checkpoint's tokenizer (`tokenization.load_tokenizer`), with --chat-template's template (a name
    of `CHAT_TEMPLATES` or a Jinja file) in place of its own when given."""
    return tokenization.load_tokenizer(path, None if chat_template is None else read_chat_template(chat_template))
