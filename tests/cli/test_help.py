"""The `thunderep` commands' help: every option explained with its default, no internal names, one format,
and parsing that imports nothing heavy (the time --help takes: `thunderep bench cli-start`)."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys

import pytest

from thunderep import cli


def _commands():
    return list(cli.COMMANDS)


def _parsers(name: str) -> list[argparse.ArgumentParser]:
    """`thunderep NAME`'s parser and, for bench, every target's."""
    p = cli.command_parser(name)
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return [p] + [sp for action in subs for sp in action.choices.values()]


def _help_texts(p: argparse.ArgumentParser) -> str:
    return p.format_help() + "".join(a.help or "" for a in p._actions)


@pytest.mark.parametrize("name", _commands())
def test_every_option_has_help_that_shows_its_default(name):
    """Each option but -h has a help text; one that takes a value (and is not required) says its default,
    the formatter's "(default: X)" or, where the default is not a value (None), the help's own words."""
    for p in _parsers(name):
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and action.help.strip(), f"{p.prog} {action.option_strings or action.dest}: no help"
            takes_value = action.option_strings and action.nargs != 0 and not action.required
            if takes_value:
                shown = formatter._get_help_string(action)
                assert "default" in shown.lower(), f"{p.prog} {action.option_strings}: default not shown: {shown!r}"


@pytest.mark.parametrize("name", _commands())
def test_help_names_no_internal_names(name):
    """No underscore-prefixed names (`_StepWatch`, `_Ranks`: docstrings of private classes) in any help text."""
    for p in _parsers(name):
        found = re.findall(r"(?<![\w./])_[A-Za-z]\w*", _help_texts(p))
        assert not found, f"{p.prog}: {found}"


@pytest.mark.parametrize("name", _commands())
def test_one_format_for_every_command_and_bench_target(name):
    for p in _parsers(name):
        assert p.formatter_class is cli.HelpFormatter, p.prog


def test_the_formatter_appends_a_default_only_where_the_help_does_not_give_one():
    p = cli.new_parser("x")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--ep", type=int, default=None, help="ranks (default: one per GPU)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="rank counts")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU")
    p.add_argument("--rate", type=float, default=0.0, help="a rate of 5%% at most")
    text = " ".join(p.format_help().split())
    assert "optimizer steps (default: 100)" in text and "ranks (default: one per GPU)" in text
    assert "rank counts (default: 2 4)" in text and "gloo on CPU" in text and "gloo on CPU (default" not in text
    assert "a rate of 5% at most (default: 0.0)" in text


@pytest.mark.parametrize("name", _commands())
def test_help_imports_no_torch(name):
    """`thunderep NAME --help` parses and prints with nothing heavy imported: torch, transformers and numpy
    load only where a command runs (they take seconds to import)."""
    code = ("import sys; from thunderep.cli import main\n"
            "try:\n    main([sys.argv[1], '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-300:]


def test_building_every_parser_imports_no_torch():
    code = "import sys, thunderep.cli as c; c.build_parser(); print('torch' in sys.modules, 'numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "False False\n"), done.stderr


def test_the_package_loads_its_torch_names_on_first_use():
    """`import thunderep` imports no torch; every name of `__all__` still imports from it."""
    code = ("import sys, thunderep; light = 'torch' not in sys.modules\n"
            "from thunderep import *\n"
            "import thunderep as t; print(light, all(getattr(t, n) is not None for n in t.__all__), "
            "set(t.__all__) <= set(dir(t)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (0, "True True True\n"), done.stderr
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        importlib.import_module("thunderep").Nope  # noqa: B018


def test_kernel_bench_variants_parse_alike_in_the_cli_and_the_library():
    """thunderep, thunderep:<pin>, thunderep:<format> and thunderep:<format>:<pin> are taken, as (format,
    pin); anything else is refused by both the CLI's check (no torch) and the benchmark's parser."""
    from thunderep.bench.kernels import variant
    from thunderep.cli.bench import _known_variant

    good = {"thunderep": (None, None), "thunderep:int4": ("int4", None), "thunderep:nopdl": (None, "nopdl"),
            "thunderep:int4:packed": ("int4", "packed"), "thunderep:mxfp4:dequant": ("mxfp4", "dequant"),
            "thunderep:fp8row:nopdl": ("fp8row", "nopdl"), "thunderep:int4-g128": ("int4-g128", None)}
    for name, parsed in good.items():
        assert _known_variant(name) and variant(name) == parsed, name
    for name in ("thunderep:", "thunderep:int4:int4", "thunderep:packed:int4", "thunderep:bogus",
                 "thunderep:int4:packed:nopdl", "thunderepx:int4"):
        assert not _known_variant(name), name
        with pytest.raises(ValueError, match="thunderep:<format>:<pin>"):
            variant(name)


def test_the_options_mirrored_for_help_equal_the_library_s():
    """The names the bench and model options offer are written in the CLI (so that --help imports no torch);
    they are the library's own."""
    from thunderep.bench import balancer, control_gpu, kernels, link
    from thunderep.bench import bytes as bytes_bench
    from thunderep.cli import bench
    from thunderep.hf import fp8

    assert bench.P2P_SETTINGS == control_gpu.P2P_SETTINGS and bench.TRACES == balancer.TRACES
    assert bench.LINK_SETTINGS == tuple(link.SETTINGS) and bench.LINK_OPS == link.OPS
    assert bench.SHAPES == tuple(kernels.SHAPES) and bench.IMPLS == kernels.IMPLS and bench.COPY == kernels.COPY
    assert bench.PINS == tuple(kernels.PINS) and bench.FORMATS == tuple(kernels.FORMATS)
    assert bench.HF_MXFP4 == kernels.kernels4.NAME
    assert bench.MODELS == tuple(bytes_bench.MODELS)
    assert cli.EXPERTS_DTYPES == fp8.EXPERTS_DTYPES
    from thunderep.cli import serve
    from thunderep.serve import tool_calls

    assert serve.TOOL_CALL_PARSERS == tool_calls.PARSER_NAMES
    from thunderep.bench import auto_mode
    from thunderep.cli import bench_ep

    assert bench_ep.SHAPES == tuple(auto_mode.SHAPES)


def test_ep_defaults_say_why():
    """--ep: 1 for generate (one process: the quickest start), one rank per GPU for finetune and train."""
    helps = {name: " ".join(cli.command_parser(name).format_help().split()) for name in ("generate", "finetune",
                                                                                         "train")}
    assert "(default 1: this process alone, the quickest start and enough for a model that fits one device;" \
        in helps["generate"]
    assert "(default: one per GPU of this host, as many as divide the model's experts, so that training uses every " \
           "GPU;" in helps["finetune"]
    assert "so that every GPU holds a share of the experts" in helps["train"]


def test_top_level_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: thunderep [-h] [-V] COMMAND ...") and all(name in out for name in cli.COMMANDS)
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
