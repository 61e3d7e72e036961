"""What the command-line tools of `infer/` and `train/` share, and the library does not need: flags,
prompt files, chat templates, named data sets, exit codes, compile cache and multi-process set-up.

Both tool packages import it (`from clover_jax import _cli as cli`, then `cli.read_prompts(...)`); neither
imports the other. It lives under the library as a private subpackage so the wheel installs no top-level
name of its own; the library itself never imports it (the front door, `clover_jax/__init__.py`, hands the
prompt readers, the chat-template tokenizer and `StreamPrinter` on to notebook users by name, imported
only when one is asked for).
Everything a user can get wrong becomes a `CloverError`, which `run_main` turns into one `error: ...`
line and exit status 2 (130 after Ctrl-C, 141 when the reader of stdout has gone).
"""

from clover_jax._cli.chat import (
    CHAT_TEMPLATES,
    VICUNA_SYSTEM,
    add_chat_flags,
    chat_template_flag,
    load_tokenizer,
    read_chat_template,
)
from clover_jax._cli.prompts import (
    default_prompts,
    encode_prompts,
    first_prompt,
    prompt_system,
    prompt_turns,
    read_prompt_turns,
    read_prompts,
    read_records,
    record_system,
)
from clover_jax._cli.run import (
    CLOSED_PIPE,
    INTERRUPTED,
    SEEDS,
    at_least,
    batches,
    check_output_dir,
    check_output_file,
    check_plot_format,
    check_seeds,
    exit,
    numbers,
    run_main,
    seed,
)
from clover_jax._cli.runtime import (
    COMPILE_CACHE_ENV,
    add_compile_cache_flag,
    add_mesh_flags,
    default_compile_cache,
    init_distributed,
    mesh_of,
    use_compile_cache,
)
