"""Write trained heads in a published drafter format, for other engines to load.

    python -m train.export --heads models/reference/heads/medusa --format medusa --out exports/medusa
    python -m train.export --heads heads/eagle3 --format sglang --out exports/eagle3-sglang --base $MODEL

Reads heads exported by train.train (heads.json + heads.safetensors) onto their base model, and writes
them through the format's own module (`clover_jax.io.formats`): the tensor names, config keys and
layouts that format's loader expects, every file of the export replaced together. train.train's
--export-format writes the same exports beside its --out (`write_exports`).
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from clover_jax import DTYPES, Llama, load_pretrained
from clover_jax import _cli as cli
from clover_jax.errors import CloverError
from clover_jax.io import formats, sources
from clover_jax.training import CONFIG, Drafter, load_heads, read_heads_config, registry

FORMATS_HELP = ("sglang (SpecForge / SGLang EAGLE-3: LlamaForCausalLMEagle3), speculators (vLLM's speculators "
                "EAGLE-3), medusa (Medusa-1's medusa_lm_head.safetensors), eagle1 (the EAGLE authors' EAGLE-1), "
                "dflash or dflash2 (the DFlash authors' DFlashDraftModel, DFlash2DraftModel), dspark or domino "
                "(SpecForge's DSparkDraftModel, DominoDraftModel)")


def parse_formats(values: list[str] | None, method: str) -> list[str]:
    """The format names of repeated and/or comma-separated --export-format values, each checked to exist
    and to write `method`'s drafters (a format's METHOD), so a run is refused before it trains."""
    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    for name in names:
        fmt = formats.exporter(name)
        if fmt.METHOD != method:
            raise CloverError(f"--export-format {name} writes {registry.title(fmt.METHOD)} drafters, not "
                              f"{registry.title(method)}'s; drop it or train --method {fmt.METHOD}")
    return list(dict.fromkeys(names))


def export_dir(out: str | Path, name: str) -> Path:
    """Where train.train's --export-format NAME writes: OUT-NAME beside its --out."""
    out = Path(out)
    return out.parent / f"{out.name}-{name}"


def check_out(out: str | Path, heads: str | Path | None = None, flag: str = "--out") -> None:
    """Refuse, up front, an export folder that holds our own heads (an export there would be shadowed by
    them) or one that cannot be written."""
    out = Path(out)
    if (out / CONFIG).is_file() or (heads is not None and out.resolve() == Path(heads).resolve()):
        raise CloverError(f"{flag} {out}: holds heads.json (our heads); write the export into another folder")
    cli.check_output_dir(out, flag)


def cast(drafter: Drafter, dtype) -> None:
    """The drafter's floating parameters cast to `dtype` (what the export stores), in place."""
    floating = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    nnx.update(drafter, jax.tree.map(floating, nnx.state(drafter, nnx.Param)))


def verifier_name(base: str | Path) -> str:
    """What an export names its base model by, so the other project's loader finds it (speculators'
    `from_pretrained` reads the verifier's config by this name): a named model's Hub id, an existing
    directory's absolute path, anything else (a Hub id, a path on the serving machine) as it is."""
    source = sources.SOURCES.get(str(base))
    if source is not None and source.hub_id:
        return source.hub_id
    return str(Path(base).resolve()) if Path(base).is_dir() else str(base)


def export(drafter: Drafter, base: Llama, out: str | Path, name: str, base_name: str | None = None) -> Path:
    """Write `drafter` (for `base`) in format `name` into `out`; `base_name` (the base model's --base, or
    a --verifier), as `verifier_name` gives it, goes to the formats whose config names the target model."""
    fmt = formats.exporter(name)
    named = base_name is not None and "base_name" in inspect.signature(fmt.export).parameters
    return fmt.export(drafter, base, Path(out), **({"base_name": verifier_name(base_name)} if named else {}))


def check_exportable(drafter: Drafter, base: Llama, names: list[str], base_name: str | None) -> None:
    """train.train's --export-format, tried on the drafter before it trains: each format's export written
    into a scratch folder and thrown away, so what a format cannot hold (a draft layer with q/k/v biases,
    a feature layer its runtimes do not capture) is refused before the training, not after it."""
    if not names:
        return
    with tempfile.TemporaryDirectory(prefix="clover-export-check-") as tmp:
        for name in names:
            try:
                export(drafter, base, Path(tmp) / name, name, base_name)
            except CloverError as e:
                raise CloverError(f"--export-format {name}: {e}; drop the flag (train.export can still write "
                                  "another format later)") from None


def write_exports(drafter: Drafter, base: Llama, out: str | Path, names: list[str], base_name: str | None,
                  dtype) -> list[Path]:
    """train.train's --export-format: each format's export of `drafter`, stored in `dtype`, beside `out`."""
    if not names:
        return []
    cast(drafter, dtype)
    written = []
    for name in names:
        try:
            written.append(export(drafter, base, export_dir(out, name), name, base_name))
        except CloverError as e:  # check_exportable refused what it could; the training itself is kept
            raise CloverError(f"{e} (--export-format {name}; the trained heads are saved in {out})") from None
        print(f"wrote the heads as {name} to {written[-1]}")
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.export",
        description="Write heads exported by train.train in another project's drafter format, for its engine to "
                    "load (infer.generate --heads reads these formats too).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", "--heads", dest="heads", required=True, metavar="DIR",
                   help="a drafter (draft heads or a draft model) written by train.train (heads.json + "
                        "heads.safetensors); --heads is the same flag, by its older name")
    p.add_argument("--format", required=True, metavar="NAME", help=f"the format to write: {FORMATS_HELP}")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write the export into (made if missing; the format's files there are replaced "
                        "together); not the heads' own folder")
    p.add_argument("--base", metavar="MODEL",
                   help="the base model the heads were trained on (a checkpoint directory, .gguf file, Hub id or "
                        "named model), which some formats copy from (the lm_head) and name in their config "
                        "(default: the --base recorded in heads.json by train.train)")
    p.add_argument("--verifier", metavar="NAME",
                   help="what the export names the base model by (speculators' verifier, Medusa-1's "
                        "base_model_name_or_path), for the other project to load it by (default: the Hub id of a "
                        "named --base, else the --base directory made absolute, or the Hub id)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="dtype the exported tensors are stored in (published drafters are mostly bfloat16)")
    return p


def run(args) -> int:
    meta = read_heads_config(args.heads)
    method = meta["heads"]["method"]
    parse_formats([args.format], method)
    check_out(args.out, args.heads)
    base_name = args.base or (meta.get("training") or {}).get("base")
    if not base_name:
        raise CloverError(f"{args.heads}: heads.json names no base model; pass --base MODEL")
    _, base = load_pretrained(sources.model_dir(base_name), dtype=jnp.float32)
    drafter = load_heads(args.heads, base, method)
    cast(drafter, DTYPES[args.dtype])
    out = export(drafter, base, args.out, args.format, args.verifier or base_name)
    print(f"wrote {registry.title(method)} heads {args.heads} as {args.format} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    cli.exit(main())
