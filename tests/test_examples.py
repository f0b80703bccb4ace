"""Every command in README.md's fenced bash blocks and in the examples' YAML headers runs as written on a
fresh clone (issue 27).

The offline tiny commands are RUN, exactly as written, with the working directory a copy of what a fresh
clone holds (``examples/`` without its git-ignored ``data/``, ``packs/`` and ``outputs/``), in document
order, each distinct command once. The others need the 12.8B files, hub downloads, GPUs or a server:
they are parsed by the command's own parser (the subcommand exists, argparse accepts the flags), their
example configs load with the command's overrides, and a pretraining config's stages must read packs that
the same block or header made before. Offline commands whose run is already an existing test are parsed
only (``COVERED_ELSEWHERE``, to keep CI short); a ``...`` token means "your other flags" and is dropped.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ("krea2", "python", "pip", "bash", "accelerate", "torchrun")
# Git-ignored outputs of the examples' own commands: absent on a fresh clone.
NOT_IN_A_CLONE = ("data", "packs", "outputs")
# Offline commands not run here because an existing test runs the same thing (CI time counted once).
COVERED_ELSEWHERE = {
    "app.py": "tests/test_app.py serves the demo on tiny-random and drives it in a browser",
    "examples/train_lora_tiny.yaml": "tests/test_finetune_train.py trains a tiny-random LoRA on a synthetic set",
    "examples/train_edit_lora_tiny.yaml": "tests/test_finetune_pairs.py trains its config on its synthetic pairs",
    "examples/posttrain_dpo_tiny.yaml": "tests/test_posttrain_dpo.py runs DPO on tiny-random with synthetic pairs",
    "examples/posttrain_grpo_tiny.yaml": "tests/test_posttrain_grpo.py runs GRPO on tiny-random",
    "examples/posttrain_draft_tiny.yaml": "tests/test_posttrain_draft.py runs DRaFT on tiny-random",
    "examples/posttrain_distill_tiny.yaml": "tests/test_posttrain_distill.py distils tiny-random",
    "--replay": "tests/test_pretrain.py replays steps of the same tiny two-stage run",
}
# A tiny command on a 2-core machine takes 2-20 s quiet; 10x that for a machine shared with other jobs.
RUN_TIMEOUT_S = 300


def join_continuations(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def tokens(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def split_commands(line: str) -> list[str]:
    """``a && b`` -> [a, b]; comments stripped, whitespace normalised."""
    words = tokens(line)
    commands, current = [], []
    for word in words + ["&&"]:
        if word == "&&":
            if current:
                commands.append(shlex.join(current))
            current = []
        else:
            current.append(word)
    return commands


def readme_blocks() -> list[tuple[str, list[str]]]:
    """(section heading, its commands) for each fenced bash block of README.md."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        headings = re.findall(r"^## (.+)$", text[:match.start()], flags=re.M)
        commands = [c for line in join_continuations(match.group(1)) for c in split_commands(line)]
        blocks.append((headings[-1] if headings else "", commands))
    return blocks


def header_commands(path: Path) -> list[str]:
    """Commands in a YAML's leading comment block: lines ``#   PROGRAM ...`` (env assignments allowed)."""
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        match = re.match(r"^#\s{2,}(\S.*)$", line)
        if match and program_of(tokens(match.group(1))) in PROGRAMS:
            commands.extend(split_commands(match.group(1)))
    return commands


def header_text(path: Path) -> str:
    lines = path.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return "\n".join(lines[:end])


def program_of(words: list[str]) -> str | None:
    words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    return words[0] if words else None


def split_env(command: str) -> tuple[dict[str, str], list[str]]:
    words = tokens(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, [w for w in words if w != "..."]


def covered_by(argv: list[str]) -> str | None:
    return next((why for key, why in COVERED_ELSEWHERE.items() if key in argv), None)


def runs_here(argv: list[str]) -> bool:
    """Offline and cheap: names tiny-random or krea2-digits, a ``*_tiny.yaml`` example or the tiny example's data."""
    offline = any(w in ("tiny-random", "krea2-digits") or re.fullmatch(r"examples/\w+_tiny\.yaml", w) or w.startswith("examples/data/tiny")
                  for w in argv)
    return offline and argv[0] != "pip" and covered_by(argv) is None


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A working directory holding what a fresh clone's examples/ holds."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(ROOT / "examples", root / "examples", ignore=lambda d, names: [
        n for n in names if Path(d) == ROOT / "examples" and n in NOT_IN_A_CLONE])
    return root


def user_environment() -> dict[str, str]:
    """This interpreter's ``python`` / ``krea2`` first on PATH; no thread settings (a fresh shell's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def all_sequences() -> list[tuple[str, list[str]]]:
    """(where, commands): README's blocks, then each example's header, in order."""
    sequences = [(f"README.md ({heading})", commands) for heading, commands in readme_blocks()]
    sequences += [(f"examples/{p.name}", header_commands(p)) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    return sequences


def test_readme_has_exactly_two_fresh_machine_commands_with_the_ci_torch_pin():
    fresh = [commands for heading, commands in readme_blocks() if heading == "On a fresh machine"]
    assert [len(c) for c in fresh] == [2, 1], fresh  # set up && generate; tests
    (setup, generate), (tests,) = fresh
    pin = re.search(r"torch==\S+", (ROOT / ".ci" / "run").read_text()).group(0)
    assert setup == f"pip install {pin} -e ." and generate.startswith("krea2 generate ") and tests == "bash .ci/run"


def test_every_example_header_has_commands_and_the_big_ones_say_what_they_need():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        assert header_commands(path), f"{path.name}: its header shows no command"
        assert not any("OMP_NUM_THREADS=" in c for c in header_commands(path)), f"{path.name}: krea2 chooses threads now"
        if not path.name.endswith("_tiny.yaml"):
            assert "# Needs:" in header_text(path), f"{path.name}: its header must say what it needs (files, GPUs)"


def parse_with(add_parser, argv: list[str], where: str) -> object:
    import argparse

    command = add_parser(argparse.ArgumentParser().add_subparsers())
    return parse_or_fail(command, argv, where)


def parse_or_fail(parser, argv: list[str], where: str):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {shlex.join(argv)!r} is refused: {err.getvalue().strip()}")


def load_example_config(subcommand: str, args, clone: Path) -> object | None:
    """The config of a train / posttrain / pretrain command, loaded with its overrides (None: a placeholder)."""
    path = clone / args.config
    if not path.is_file():
        return None
    if subcommand == "pretrain":
        from finetune.pretrain.config import load_pretrain_config

        return load_pretrain_config(path, args.overrides)
    if subcommand == "posttrain":
        from finetune.posttrain.config import load_posttrain_config

        return load_posttrain_config(path, args.overrides)
    from finetune.config import load_config

    return load_config(path, args.overrides)


def check_parses(env: dict, argv: list[str], where: str, clone: Path, packs: set[Path]) -> None:
    """The command's own parser accepts it; its example config loads; its pretraining stages read packs made before."""
    import finetune.cli
    import finetune.posttrain.cli
    import finetune.pretrain.cli
    from krea2_diffusers.cli import build_parser

    modules = {"finetune": ("train", finetune.cli.add_parser), "finetune.posttrain": ("posttrain", finetune.posttrain.cli.add_parser),
               "finetune.pretrain": ("pretrain", finetune.pretrain.cli.add_parser)}
    program = argv[0]
    if program == "python" and argv[1] == "-m" and runs_here(argv):
        return  # a data-making script (finetune.packs.synthetic): run by the test below
    if program == "pip":
        assert argv[1] == "install", where
        return
    if program == "bash":
        script = ROOT / argv[1]
        assert script.is_file(), f"{where}: {argv[1]} is missing"
        subprocess.run(["bash", "-n", str(script)], check=True)
        return
    if program == "python" and argv[1].startswith("bench/") and argv[1].endswith(".py"):
        # A benchmark (minutes to hours: not run here): the script exists and defines each option used.
        script = ROOT / argv[1]
        assert script.is_file(), f"{where}: {argv[1]} is missing"
        source = script.read_text()
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{where}: {argv[1]} has no option {flag}"
        return
    if program == "python" and argv[1] == "app.py":
        sys.path.insert(0, str(ROOT))
        try:
            import app
        finally:
            sys.path.remove(str(ROOT))
        parse_or_fail(argparse_of(app.parse_args), argv[2:], where)
        return
    if program == "krea2":
        args = parse_or_fail(build_parser(), argv[1:], where)
        subcommand = argv[1]
    else:
        assert "-m" in argv, f"{where}: {shlex.join(argv)!r}: unknown program form"
        module = argv[argv.index("-m") + 1]
        assert module in modules, f"{where}: unknown module {module}"
        subcommand, add_parser = modules[module]
        args = parse_with(add_parser, argv[argv.index("-m") + 2:], where)
    if subcommand == "pack":
        packs.add((clone / args.out_dir).resolve())
    if subcommand in ("train", "posttrain", "pretrain"):
        config = load_example_config(subcommand, args, clone)
        if subcommand == "posttrain" and config is not None and env.get("PYTHONPATH"):
            check_reward_modules(config, clone / env["PYTHONPATH"], where)
        # README's full-size commands refer to their example's header for the packs; headers and runnable commands must be complete.
        if subcommand == "pretrain" and config is not None and (where.startswith("examples/") or runs_here(argv)):
            unmade = [s.data for s in config.stages if Path(s.data).resolve() not in packs]
            assert not unmade, f"{where}: {shlex.join(argv)!r} reads packs no earlier command made: {unmade}"


def argparse_of(parse_args):
    """An object with ``parse_args(argv)`` calling the app's own ``parse_args`` (it builds its parser inside)."""
    class Parser:
        @staticmethod
        def parse_args(argv):
            return parse_args(argv)

    return Parser


def check_reward_modules(config, folder: Path, where: str) -> None:
    """Each ``module:function`` reward is a function of ``folder/module.py`` (read, not imported: the
    tests folder has a module of the same name)."""
    for reward in getattr(getattr(config, config.method), "rewards", []):
        module, _, function = reward.function.partition(":")
        if not function:
            continue  # a built-in
        source = folder / f"{module}.py"
        assert source.is_file(), f"{where}: reward module {source} is missing"
        names = {node.name for node in ast.parse(source.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert function in names, f"{where}: {source} defines no {function}()"


def test_commands_that_cannot_run_here_are_well_formed(clone):
    checked = 0
    for where, commands in all_sequences():
        packs: set[Path] = set()
        for command in commands:
            env, argv = split_env(command)
            check_parses(env, argv, where, clone, packs)
            checked += 1
    assert checked > 40  # README and nine headers: a parser change that drops commands is noticed


def test_a_missing_pack_is_refused_with_the_command_that_makes_it(tmp_path, capsys):
    from krea2_diffusers.cli import main

    config = tmp_path / "pretrain_tiny.yaml"
    shutil.copy(ROOT / "examples" / "pretrain_tiny.yaml", config)
    assert main(["pretrain", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"pack '{tmp_path / 'packs' / '64'}' is not a folder" in err
    assert f"`krea2 pack SOURCE {tmp_path / 'packs' / '64'} --resolution 64 --batch-size 4`" in err


def torch_default_threads(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_offline_commands_run_as_written_on_a_fresh_clone(clone):
    env = user_environment()
    many_threads = torch_default_threads(env) > 1
    done = set()
    ran = []
    for where, commands in all_sequences():
        for command in commands:
            _, argv = split_env(command)
            if not runs_here(argv) or command in done:
                continue
            done.add(command)
            result = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                    timeout=RUN_TIMEOUT_S)
            assert result.returncode == 0, f"{where}: {command!r} failed:\n{result.stderr[-3000:]}"
            loads_a_model = argv[:2] in (["krea2", "generate"], ["krea2", "expand"], ["krea2", "pretrain"])
            if loads_a_model and many_threads:  # a tiny model runs single-threaded, and says so
                assert "threads: 1 instead of torch's" in result.stderr, f"{where}: {command!r}"
            ran.append(argv[:2])
    assert (clone / "outputs" / "seven.png").is_file()
    assert any((clone / "examples" / "outputs" / "pretrain-tiny" / "pma").glob("*.safetensors"))
    assert ["krea2", "expand"] in ran and ran.count(["krea2", "pack"]) == 2
