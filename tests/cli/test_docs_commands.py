"""The README's and docs' commands against the real CLI: every `python -m kvpool ...`
parses with the command's own argparse parser, every flag and choice list in a usage
line exists and is complete, every `bash scripts/X.sh` is there, and every command's
--help prints help (so the docs cannot drift from the CLI)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpool import __main__ as kvpool_main, info
from kvpool.tools.conformance import cli as conformance_cli, porting as porting_cli
from kvpool.tools.locality import cli as locality_cli
from kvpool.tools.replay import cli as replay_cli
from tests.support.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PARSERS = {
    "replay": replay_cli.build_parser,
    "locality": locality_cli.build_parser,
    "conformance": conformance_cli.build_parser,
    "porting": porting_cli.build_parser,
    "info": info.build_parser,
}
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def _snippets() -> list[tuple[str, str]]:
    """(file, text) for every line of a fenced code block and every inline code span."""
    out = []
    for path in DOCS:
        text = path.read_text()
        name = str(path.relative_to(REPO))
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
            out += [(name, line) for line in block.splitlines() if line.strip()]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        out += [(name, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", prose)]
    return out


def _kvpool_commands() -> list[tuple[str, str, str, list[str]]]:
    """(file, snippet, subcommand, args) for each `python -m kvpool SUB ...` in the docs."""
    found = []
    for where, snippet in _snippets():
        if "-m kvpool" not in snippet:
            continue
        text = snippet.replace("\\|", "|")
        try:
            words = shlex.split(text, comments=True)
        except ValueError:
            continue
        for i in range(len(words) - 2):
            if words[i] == "-m" and words[i + 1] == "kvpool" and words[i + 2] in PARSERS:
                rest = []
                for w in words[i + 3:]:
                    if w in SHELL_OPERATORS:
                        break
                    rest.append(w)
                found.append((where, snippet, words[i + 2], rest))
    return found


COMMANDS = _kvpool_commands()


def _is_usage(args: list[str]) -> bool:
    # "[--workload grpo|long-sequential|pd-async] [--json PATH]": a synopsis, not a command.
    return any(a.startswith("[") or a.endswith("]") or "..." in a or "|" in a for a in args)


def test_the_docs_name_kvpool_commands_at_all():
    subcommands = {sub for _, _, sub, _ in COMMANDS}
    assert subcommands == set(PARSERS), subcommands
    assert len([c for c in COMMANDS if not _is_usage(c[3])]) >= 15


@pytest.mark.parametrize("where,snippet,sub,args", [c for c in COMMANDS if not _is_usage(c[3])],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_every_documented_command_parses_with_the_real_parser(where, snippet, sub, args, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # relative output paths of the docs are relative to the checkout
    try:
        PARSERS[sub]().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `{snippet}` does not parse: {capsys.readouterr().err.strip().splitlines()[-1]}")


@pytest.mark.parametrize("where,snippet,sub,args", [c for c in COMMANDS if _is_usage(c[3])],
                         ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_every_flag_and_choice_list_of_a_documented_synopsis_is_the_parsers(where, snippet, sub, args):
    parser = PARSERS[sub]()
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    for i, word in enumerate(args):
        flag = word.strip("[]").split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        assert flag in actions, f"{where}: `{snippet}` names {flag}, which `{sub}` does not have"
        action = actions[flag]
        if action.choices and i + 1 < len(args) and "|" in args[i + 1]:
            listed = set(args[i + 1].strip("[]").split("|"))
            assert listed == set(action.choices), (f"{where}: {flag} lists {sorted(listed)}, "
                                                  f"the parser has {sorted(action.choices)}")


def test_every_named_script_exists():
    named = {m for _, s in _snippets() for m in re.findall(r"\bbash (scripts/[\w.-]+\.sh)", s)}
    named |= {m for p in DOCS for m in re.findall(r"\bbash (scripts/[\w.-]+\.sh)", p.read_text())}
    assert "scripts/replay.sh" in named and "scripts/test.sh" in named
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing


@pytest.mark.parametrize("sub", sorted(PARSERS))
def test_every_command_prints_its_help(sub, capsys):
    with pytest.raises(SystemExit) as exc:
        kvpool_main.main([sub, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m kvpool {sub}")


def _has_python(version: str) -> bool:
    if shutil.which(f"python{version}") and subprocess.run([f"python{version}", "-c", "pass"],
                                                          capture_output=True).returncode == 0:
        return True
    return any(Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))


def test_the_readme_wheel_command_finds_its_interpreters():
    line = next(s for where, s in _snippets() if where == "README.md" and "scripts/build-wheel.sh python" in s)
    pythons = [w for w in shlex.split(line, comments=True) if w.startswith("python")]
    assert pythons, line
    for py in pythons:
        if not _has_python(py.removeprefix("python")):
            pytest.skip(f"{py} is not installed on this machine")
    proc = subprocess.run(["bash", "scripts/build-wheel.sh", "--resolve", *pythons], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for py, resolved in zip(pythons, proc.stdout.split()):
        ver = subprocess.run([resolved, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
        assert ver == py.removeprefix("python"), (py, resolved, ver)
