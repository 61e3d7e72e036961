"""train.train --option NAME=VALUE: a method's own options from the command line, read as JSON values or
comma lists, handed to the method's config (which refuses what it lacks, by name, in one line)."""

import argparse

import pytest

from clover_jax.drafters.registry import drafter_config
from clover_jax.errors import CloverError
from train import options, train


@pytest.mark.parametrize("text, expected", [
    ("draft_layers=2", ("draft_layers", 2)),
    ("target_layer_ids=1,14,26", ("target_layer_ids", [1, 14, 26])),
    ("target_layer_ids=[3]", ("target_layer_ids", [3])),
    ("input_embedding_scale=0.5", ("input_embedding_scale", 0.5)),
    ("final_logit_softcapping=null", ("final_logit_softcapping", None)),
    ("embed_source=input", ("embed_source", "input")),
])
def test_option_values_read_as_json_or_comma_lists(text, expected):
    assert options.method_option(text) == expected


@pytest.mark.parametrize("text", ["draft_layers", "=2", ""])
def test_option_without_a_name_and_value_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
        options.method_option(text)


def test_options_reach_the_methods_config():
    args = train.build_parser().parse_args(
        ["--method", "dflash", "--base", "b", "--data", "d", "--out", "o", "--num-heads", "7",
         "--option", "draft_layers=2", "--option", "target_layer_ids=1,14,26"])
    cfg = drafter_config(args.method, args.num_heads, **options.method_options(args))
    assert (cfg.num_heads, cfg.draft_layers, cfg.target_layer_ids) == (7, 2, (1, 14, 26))


def test_an_option_the_method_lacks_is_refused_by_name():
    args = train.build_parser().parse_args(
        ["--method", "medusa", "--base", "b", "--data", "d", "--out", "o", "--option", "draft_layers=2"])
    with pytest.raises(CloverError, match="draft_layers"):
        drafter_config(args.method, args.num_heads, **options.method_options(args))


def test_help_lists_every_methods_options():
    text = train.build_parser().format_help()
    for name in ("head_layers", "aux_layer_ids", "target_layer_ids", "selector_top_k"):
        assert name in " ".join(text.split())
