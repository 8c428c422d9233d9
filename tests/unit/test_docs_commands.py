"""The deployment sections of the docs and the images' entry points name commands that exist.

Every command in the bash blocks of the four deployment sections is extracted (pipelines,
`&&` lists, `$(...)`, `sh -c` scripts and the command run by `kubectl exec ... --` or
`docker compose exec SERVICE` included) and run with `--help`: the command must exist, take
`--help`, and every flag it is given must appear in its help. Nothing else is run.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harnessrl.apps.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = (
    "Deploy with docker-compose",
    "Deploy on Kubernetes",
    "Plug in a custom reward service",
    "Trace a trajectory end to end in Jaeger",
)
OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>>", "&>"}
VENV_BIN = Path(sys.executable).parent
NOT_RUN = {"sh", "bash"}
"""Shells are not asked for help: their `-c` script is checked command by command."""


# -- extraction --------------------------------------------------------------------------


def section(title: str) -> str:
    """The section of that title in README.md or a page of docs/ (exactly one of them)."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    head = f"\n## {title}\n"
    found = [page.read_text() for page in pages if head in page.read_text()]
    assert len(found) == 1, f"{len(found)} pages have a section '## {title}' (one expected)"
    body = found[0].split(head, 1)[1]
    return body.split("\n## ", 1)[0]


def bash_lines(text: str) -> list[str]:
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [line for line in joined.splitlines() if line.strip()]
    return lines


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line, substitutions and nested commands included."""
    found: list[list[str]] = []
    for inner in re.findall(r"\$\(([^()]*)\)", line):
        found += split_commands(inner)
    line = re.sub(r"\$\(([^()]*)\)", "SUBSTITUTED", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    current: list[str] = []
    tokens = list(lexer)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token in OPERATORS:
            found += nested(current)
            current = []
        elif token in REDIRECTS or re.fullmatch(r"\d?[<>]+&?", token):
            index += 1  # the file redirected to or from
        else:
            current.append(token)
        index += 1
    return found + nested(current)


def nested(argv: list[str]) -> list[list[str]]:
    """argv without leading VAR=value, and the commands it runs inside itself."""
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    if not argv:
        return []
    if Path(argv[0]).name in NOT_RUN:
        assert argv[1:2] == ["-c"] and len(argv) >= 3, f"a shell without -c SCRIPT: {argv}"
        return split_commands(argv[2])
    if argv[0] == "kubectl" and "--" in argv:
        cut = argv.index("--")
        return [argv[:cut], *nested(argv[cut + 1 :])]
    if argv[:3] == ["docker", "compose", "exec"] or argv[:2] == ["docker", "run"]:
        for cut, token in enumerate(argv[3:], start=3):
            if token == "harnessrl" or Path(token).name in NOT_RUN:
                return [argv[:cut], *nested(argv[cut:])]
    return [argv]


def documented_commands() -> list[list[str]]:
    return [
        argv
        for title in SECTIONS
        for line in bash_lines(section(title))
        for argv in split_commands(line)
    ]


# -- running with --help -----------------------------------------------------------------


def resolve(argv: list[str]) -> list[str]:
    program = argv[0]
    if program in ("harnessrl", ".venv/bin/harnessrl"):
        return [str(VENV_BIN / "harnessrl"), *argv[1:]]
    if program in ("python", "python3", ".venv/bin/python"):
        return [sys.executable, *argv[1:]]
    if program == "printf":
        return ["/usr/bin/printf", *argv[1:]]
    return argv


def help_runs(argv: list[str]) -> list[list[str]]:
    """How to ask `argv` for help: the command itself, and the levels above it whose
    options it may use (openssl takes -help after its subcommand, kubectl lists its global
    flags under `kubectl options`)."""
    if argv[0] == "openssl":
        return [[*argv[:2], "-help"]]
    runs = [[*argv, "--help"]]
    words = [a for a in argv[1:3] if not a.startswith("-")]
    if words and argv[1] == words[0]:
        runs.append([argv[0], words[0], "--help"])
    if argv[0] == "kubectl":
        runs.append(["kubectl", "options"])
    return runs


@functools.cache
def compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return done.returncode == 0


def flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv[1:] if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a)]


def command_id(argv: list[str]) -> str:
    return shlex.join(argv)[:80]


COMMANDS = documented_commands()


def test_every_section_has_commands() -> None:
    for title in SECTIONS:
        assert bash_lines(section(title)), f"'{title}' shows no commands"
    programs = {Path(a[0]).name for a in COMMANDS}
    assert {"harnessrl", "docker", "kubectl", "python"} <= programs, programs


def test_extraction_finds_nested_commands() -> None:
    line = "kubectl -n ns exec -i deploy/c -- sh -c 'cat > /tmp/t && harnessrl submit /tmp/t' < f"
    assert split_commands(line) == [
        ["kubectl", "-n", "ns", "exec", "-i", "deploy/c"],
        ["cat"],
        ["harnessrl", "submit", "/tmp/t"],
    ]
    line = "X='[1]' docker compose exec controller harnessrl status  # note"
    assert split_commands(line) == [
        ["docker", "compose", "exec", "controller"],
        ["harnessrl", "status"],
    ]
    assert split_commands('printf "a=%s" "$(openssl rand -hex 32)" > .env') == [
        ["openssl", "rand", "-hex", "32"],
        ["printf", "a=%s", "SUBSTITUTED"],
    ]


@pytest.mark.parametrize("argv", COMMANDS, ids=command_id)
def test_documented_command_exists_with_its_flags(argv: list[str]) -> None:
    if argv[:2] == ["docker", "compose"] and not compose_available():
        pytest.skip("the Docker Compose v2 plugin is not installed on this machine")
    program = resolve(argv)
    assert shutil.which(program[0]) or Path(program[0]).is_file(), f"{argv[0]}: no such program"
    runs = help_runs(program)
    texts = []
    for run in runs:
        done = subprocess.run(
            run, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
        )
        if run is runs[0]:
            assert done.returncode == 0, f"`{shlex.join(run)}` failed:\n{done.stdout}{done.stderr}"
        texts.append(done.stdout + done.stderr)
    helptext = "\n".join(texts)
    for flag in flags(argv):
        pattern = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
        assert re.search(pattern, helptext), f"{shlex.join(argv)}: {flag} is not in its help"


# -- the images --------------------------------------------------------------------------


def dockerfile_json(path: Path, instruction: str) -> list[str]:
    import json

    lines = [ln for ln in path.read_text().splitlines() if ln.startswith(f"{instruction} ")]
    assert len(lines) == 1, f"{path.name}: one {instruction} expected"
    value = json.loads(lines[0].removeprefix(f"{instruction} "))
    assert isinstance(value, list), f"{path.name}: {instruction} in exec form"
    return [str(v) for v in value]


def test_the_image_entry_point_is_the_cli_and_its_default_command_parses() -> None:
    dockerfile = ROOT / "deploy" / "Dockerfile"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert dockerfile_json(dockerfile, "ENTRYPOINT") == ["harnessrl"]
    assert scripts["harnessrl"] == "harnessrl.apps.cli:main"
    cmd = dockerfile_json(dockerfile, "CMD")
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(cmd)
    assert done.value.code == 0, f"`harnessrl {' '.join(cmd)}` is not a valid default"
    text = dockerfile.read_text()
    assert re.search(r"^USER (?!root|0\b)\S+", text, flags=re.M), "the image runs as non-root"
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, flags=re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"deploy/Dockerfile copies {path}, which is missing"


def test_the_reward_example_image_runs_the_example_server() -> None:
    dockerfile = ROOT / "examples" / "reward_service" / "Dockerfile"
    entry = dockerfile_json(dockerfile, "ENTRYPOINT")
    cmd = dockerfile_json(dockerfile, "CMD")
    assert entry == ["python", "server.py"]
    assert "COPY examples/reward_service/server.py ./" in dockerfile.read_text()
    done = subprocess.run(
        [sys.executable, "examples/reward_service/server.py", *cmd, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    for flag in flags(["server.py", *cmd]):
        assert flag in done.stdout, f"server.py has no {flag}"


def test_compose_commands_name_services_and_profiles_the_file_has() -> None:
    """Checked even where the Compose plugin is missing: what the commands refer to."""
    import yaml

    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = set(spec["services"])
    profiles = {p for s in spec["services"].values() for p in s.get("profiles", [])}
    seen = 0
    for argv in COMMANDS:
        if argv[:2] != ["docker", "compose"]:
            continue
        seen += 1
        rest = argv[2:]
        while rest and rest[0].startswith("-"):
            assert rest[0] == "--profile", f"{shlex.join(argv)}: unexpected {rest[0]}"
            assert rest[1] in profiles, f"{shlex.join(argv)}: no profile {rest[1]}"
            rest = rest[2:]
        subcommand, *args = rest
        assert subcommand in {"up", "ps", "logs", "exec", "down"}, shlex.join(argv)
        for arg in args:
            if not arg.startswith("-"):
                assert arg in services, f"{shlex.join(argv)}: no service {arg}"
    assert seen >= 5


# -- commands named in running text --------------------------------------------------------

_PLACEHOLDER = re.compile(r"[<>|\[\]{}]|\.\.\.|…")


def inline_commands() -> list[tuple[str, str]]:
    """(page, text) of every `harnessrl ...` code span in README.md, ARCHITECTURE.md and
    docs/ (fenced blocks are checked above and in test_docs_shell.py)."""
    found = []
    for page in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted(ROOT.glob("docs/*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`(harnessrl [^`]+)`", text):
            found.append((str(page.relative_to(ROOT)), span))
    return found


def unknown_words(span: str) -> str | None:
    """What of `harnessrl ...` the CLI does not have (a subcommand, a flag), or None.

    Placeholders (`<service>`, `a|b`, `...`) end the check; a word where the command takes
    no positional argument is a subcommand that does not exist."""
    parser = build_parser()
    expects_value = False
    for word in shlex.split(span)[1:]:
        if _PLACEHOLDER.search(word):
            return None
        commands = next(
            (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        if word.startswith("-"):
            action = parser._option_string_actions.get(word.split("=")[0])
            if action is None:
                return f"{parser.prog} has no flag {word}"
            expects_value = action.nargs != 0 and "=" not in word
            continue
        if expects_value:
            expects_value = False
            continue
        if commands is not None:
            if word not in commands.choices:
                return f"{parser.prog} has no command {word!r}"
            parser = commands.choices[word]
            continue
        if not any(not a.option_strings for a in parser._actions):
            return f"{parser.prog} takes no argument {word!r}"
        return None  # a positional argument: its value is the page's business
    return None


@pytest.mark.parametrize(("page", "span"), inline_commands(), ids=lambda v: str(v)[:60])
def test_a_command_named_in_the_text_exists(page: str, span: str) -> None:
    assert unknown_words(span) is None, f"{page}: `{span}`: {unknown_words(span)}"


def test_the_inline_check_finds_a_command_that_does_not_exist() -> None:
    assert unknown_words("harnessrl sessions key") is not None
    assert unknown_words("harnessrl bench lode") is not None
    assert unknown_words("harnessrl up --no-such-flag") is not None
    assert unknown_words("harnessrl policy status|promote") is None
    assert unknown_words("harnessrl feedback send SESSION NAME VALUE") is None
