"""One command-line convention (`mkresearch.cli.options`): every command that takes a model names
it first, takes `--batch` as one value or a comma list and a sequence length as `--context`; every
command is dispatched through `cli.main.COMMANDS` and its `--help` ends with examples that parse;
the old spellings still work and print one line naming the new one."""

import argparse
import json
import re
import shlex

import pytest

from mkresearch.cli import main as cli
from mkresearch.cli import options


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def visible_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions if action.help != argparse.SUPPRESS
            for name in action.option_strings}


def takes_model(parser: argparse.ArgumentParser) -> bool:
    return any(action.dest == "model" and not action.option_strings for action in parser._actions)


MODEL_COMMANDS = [name for name, p in subparsers().items() if takes_model(p)]
CONTEXT_COMMANDS = [name for name, p in subparsers().items() if "--context" in visible_options(p)]


def test_every_command_is_in_the_one_dispatch_table():
    assert list(subparsers()) == list(cli.COMMANDS)
    assert MODEL_COMMANDS == ["info", "decode", "bench", "compile", "plan", "predict"]
    assert CONTEXT_COMMANDS == ["info", "compile", "plan", "predict"]


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_the_same_flags_for_model_batch_and_context(command):
    """MODEL first, --batch one value or a list (a tuple either way), --context; none of the old
    spellings shown in --help, and no other name for a batch or a sequence length."""
    parser = subparsers()[command]
    shown = visible_options(parser)
    assert not {"--model", "--batches", "--layout", "--seq-len"} & set(shown)
    assert {"--batch"} <= set(shown) and not {"--seq", "--seqlen", "--batch-size"} & set(shown)
    context = ["--context", "16"] if command in CONTEXT_COMMANDS else []
    for batch, expected in (("2", (2,)), ("1,2,4", (1, 2, 4))):
        args = cli._parser().parse_args([command, "kimi-k3-mini", "--batch", batch, *context])
        assert (args.model, args.batch) == ("kimi-k3-mini", expected)
        assert getattr(args, "context", 16) == 16 and not options.notices(args)


@pytest.mark.parametrize("command", ["info", "plan"])
def test_cache_layout_is_spelled_one_way(command):
    args = cli._parser().parse_args([command, "kimi-k3", "--cache-layout", "latent"])
    assert args.cache_layout == "latent" and not options.notices(args)


def test_rank_layout_is_spelled_one_way():
    args = cli._parser().parse_args(["predict", "kimi-k3", "--rank-layout", "release"])
    assert args.rank_layout == "release" and not options.notices(args)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_ends_with_examples_that_parse(command, capsys):
    module = cli.COMMANDS[command]
    assert 2 <= len(module.EXAMPLES) <= 3
    with pytest.raises(SystemExit) as exit:
        cli.main([command, "--help"])
    assert exit.value.code == 0
    help_text = capsys.readouterr().out.rstrip().splitlines()
    assert help_text[-len(module.EXAMPLES) - 1:] == [
        "examples:", *(f"  {line}" for line in module.EXAMPLES)]
    for line in module.EXAMPLES:
        words = shlex.split(line, comments=True)
        assert words[:2] == ["mkresearch", command]
        args = cli._parser().parse_args(words[1:])
        assert not options.notices(args), line  # examples use the new spellings


# ---- the help texts: every command, the common options first, every default shown ------------
def help_of(capsys, *command: str) -> str:
    with pytest.raises(SystemExit) as exit:
        cli.main([*command, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    """`mkresearch --help` names every command of the table in its description, and lists each
    with its one-line help."""
    text = help_of(capsys)
    description = next(line for line in text.splitlines() if line.startswith("`mkresearch`"))
    assert description.endswith(": " + ", ".join(cli.COMMANDS) + ".")
    listed = [line.split()[0] for line in text.splitlines() if re.match(r" {4}[a-z]", line)]
    assert listed == list(cli.COMMANDS)


def sections(text: str) -> dict[str, list[str]]:
    """A --help text's sections (its headings: 'options', an argument group's title) -> the
    options each lists, in order."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = found.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.append(line.split()[0].rstrip(","))
    return found


def test_decode_help_leads_with_the_common_options(capsys):
    """The options a first run uses come first; the sharded megakernel's (--ranks and the
    options that only mean something with it), speculative decoding's and a checkpoint's follow,
    each in a group of its own."""
    found = sections(help_of(capsys, "decode"))
    assert found["options"] == ["-h", "--prompt-len", "--steps", "--batch", "--seed", "--backend",
                                "--format", "--cache-layout", "--chip", "--json"]
    groups = list(found)
    ranks_group = next(g for g in groups if g.startswith("several devices"))
    assert groups.index(ranks_group) == groups.index("options") + 1
    assert found[ranks_group][0] == "--ranks" and len(found[ranks_group]) == 8
    assert found["speculative decoding"] == ["--speculate", "--drafter"]
    assert sum(map(len, found.values())) == len(set(visible_options(subparsers()["decode"])
                                                     .values()))  # every option in one section


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_shows_every_default_of_steps_seed_and_chip(command, capsys):
    """--steps, --seed and --chip say their default (the parser's value, whichever it is), and
    --chip its choices; no backend that does not exist is offered."""
    from mkresearch.cli import common
    from mkresearch.hardware.chips import CHIPS

    parser = subparsers()[command]
    shown = visible_options(parser)
    helps = {flag: parser._get_formatter()._expand_help(action) for flag, action in shown.items()}
    for flag in {"--steps", "--seed", "--chip"} & set(shown):
        default = parser.get_default(shown[flag].dest)  # None: the TPU present, else tpu7x
        said = f"({common.CHIP_DEFAULT_HELP})" if default is None else f"(default {default})"
        assert helps[flag].endswith(said), (flag, helps[flag])
    if "--chip" in shown:
        assert f"one of {', '.join(CHIPS)} (" in helps["--chip"]
    assert "planned" not in parser.format_help()


@pytest.mark.parametrize("command", ["decode", "bench"])
def test_the_model_list_says_which_presets_run_on_a_cpu(command):
    """decode and bench run the model: their MODEL help names the presets that run on a CPU
    (`common.cpu_models`: every -mini, none of the full-size or -rank presets), and each of the
    others is refused in one line (tests/test_cli.py)."""
    from mkresearch.cli import common

    help_text = " ".join(subparsers()[command].format_help().split())
    assert f"these run on a CPU: {', '.join(common.cpu_models())} " in help_text
    assert common.cpu_models() == [name for name in common.config_names()
                                   if name.endswith("-mini")]


# ---- the old spellings: one line each on stderr naming the new one, the same run --------------
OLD_AND_NEW = [
    (["decode", "--model", "glm-4.5-mini"], ["decode", "glm-4.5-mini"],
     "--model is an old spelling, kept for one release: use mkresearch decode glm-4.5-mini"),
    (["bench", "glm-4.5-mini", "--batches", "1", "2"],
     ["bench", "glm-4.5-mini", "--batch", "1,2"], "use --batch 1,2"),
    (["info", "--model", "kimi-k3"], ["info", "kimi-k3"], "use mkresearch info kimi-k3"),
    (["info", "kimi-k3", "--layout", "latent"], ["info", "kimi-k3", "--cache-layout", "latent"],
     "--layout is an old spelling, kept for one release: use --cache-layout latent"),
    (["plan", "kimi-k3", "--layout", "latent"], ["plan", "kimi-k3", "--cache-layout", "latent"],
     "use --cache-layout latent"),
    (["predict", "kimi-k3", "--layout", "release"],
     ["predict", "kimi-k3", "--rank-layout", "release"], "use --rank-layout release"),
    (["compile", "kimi-k3-rank", "--seq-len", "4096"],
     ["compile", "kimi-k3-rank", "--context", "4096"], "use --context 4096"),
]


@pytest.mark.parametrize("old, new, notice", OLD_AND_NEW)
def test_old_spellings_run_the_same_command_with_a_notice(monkeypatch, capsys, old, new, notice):
    """Dispatched through main (the command's run swapped for a recorder): the namespace the
    command sees equals the new spelling's, and stderr is one line naming the new spelling."""
    seen = []
    monkeypatch.setattr(cli.COMMANDS[old[0]], "run", lambda args: seen.append(vars(args)) or 0)
    assert cli.main(new) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(old) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mkresearch: ") and notice in lines[0], lines
    ignored = {"argv", options.NOTICES, options.MODEL_OPTION}
    assert [{k: v for k, v in s.items() if k not in ignored} for s in seen[1:]] == [
        {k: v for k, v in seen[0].items() if k not in ignored}]


def test_an_old_spelling_runs_end_to_end(capsys):
    assert cli.main(["info", "kimi-k3-mini", "--cache-layout", "latent", "--json"]) == 0
    new = capsys.readouterr()
    assert cli.main(["info", "--model", "kimi-k3-mini", "--layout", "latent", "--json"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and json.loads(old.out)["step_bytes"]["mla_cache_layout"] == "latent"
    assert len(old.err.strip().splitlines()) == 2 and "--cache-layout latent" in old.err


@pytest.mark.parametrize("argv, reason", [
    (["info", "kimi-k3", "--model", "kimi-k3-mini"], "the model is named twice"),
    (["info"], "MODEL is missing"),
    (["info", "kimi-k3", "--batch", "1,x"], "--batch '1,x' is invalid: an int >= 1 or a comma"),
    (["info", "kimi-k3", "--batch", "1,0"], "--batch 0 is invalid: an int >= 1 or a comma list"),
    (["bench", "--batches", "0"], "--batches 0 is invalid: an int >= 1"),
    (["plan", "kimi-k3", "--batch", "1,17"], "--batch 17 is invalid: each in [1, 16]"),
    (["decode", "--checkpoint", "DIR", "--prompt", "a", "kimi-k3-mini"], "--checkpoint DIR is"),
])
def test_bad_convention_input_is_one_error_line(capsys, argv, reason):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and reason in captured.err.strip().splitlines()[-1]


# ---- a batch list runs a one-batch command once per value ---------------------------------------
@pytest.mark.parametrize("command", [["info", "kimi-k3-mini", "--context", "16"],
                                     ["plan", "kimi-k3-mini"]])
def test_a_batch_list_runs_once_per_value(capsys, command):
    """--json with a list: one object per line, each the run of that batch alone."""
    assert cli.main([*command, "--batch", "1,3", "--json"]) == 0
    listed = capsys.readouterr().out.splitlines()
    singles = []
    for batch in ("1", "3"):
        assert cli.main([*command, "--batch", batch, "--json"]) == 0
        singles.append(capsys.readouterr().out.strip())
    assert listed == singles and len(listed) == 2


def test_each_batch_names_one_batch_in_a_childs_argv():
    """A `--ranks` child runs args.argv again: with a list, each run's argv names its batch."""
    args = argparse.Namespace(batch=(1, 4), argv=["decode", "--batch", "1,4", "--ranks", "2"])
    seen = []
    assert options.each_batch(args, lambda one: seen.append((one.batch, one.argv)) or 0) == 0
    assert seen == [(1, [*args.argv, "--batch", "1"]), (4, [*args.argv, "--batch", "4"])]
    assert cli._parser().parse_args(seen[1][1]).batch == (4,)  # the last --batch wins
