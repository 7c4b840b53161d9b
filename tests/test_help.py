"""What llmcli says about itself: --help and -h (panels, examples, only the options that apply), shell completion of
an option's choices, and the install hints of the extras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli


def _help(*command: str) -> str:
    result = run_cli(*command, "--help")
    assert result.code == 0, result.stderr
    return result.stdout


def test_help_offers_only_what_applies():
    import socket

    pull = _help("pull")
    assert "--hub-timeout" in pull and "KV cache" not in pull and "stats line" not in pull
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        pulled = run_cli("pull", "--hub-timeout", "1.2", "someone/x-GGUF",
                         env={"HF_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}"})
    assert pulled.code == 4 and "within 1.2 s" in pulled.stderr
    serve = _help("serve")
    assert "--endpoint" not in serve and "--endpoint-timeout" not in serve and "--reasoning" not in serve
    for command in ("count", "tokenize"):
        assert "--raw " not in _help(command)  # (the default without --chat)
    label = run_cli("count", "--chat", "q").stderr
    assert "chat prompt" in label
    refused = run_cli("count", "-s", "Be brief.", "q")  # --system shapes only a chat prompt
    assert refused.code == 2 and "add --chat" in refused.stderr


def test_help_groups_options_in_panels_and_ends_with_examples():
    shown = run_cli("run", "--help").stdout
    panels = [line for line in shown.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert panels == ["Arguments:", "Model and prompt:", "Input and conversation:", "Sampling and stopping:",
                      "Constrained output:", "Tools:", "Output:", "Batch:", "Saved templates:", "Engine:", "Prompt cache:",
                      "A server instead (--endpoint):", "Downloads (Hugging Face Hub):", "Options:"]
    assert shown.split("\nOptions:\n", 1)[1].split("\n\n")[0].count("\n  -") == 0  # only -h/--help left ungrouped
    short = run_cli("run", "-h").stdout  # issue 23: the main options, scannable; --help has them all
    assert len(short.splitlines()) < len(shown.splitlines()) // 2 and "more options" in short and "--mirostat" not in short
    assert "Examples:" in shown and 'llmcli run "Why is the sky blue?"' in shown
    assert "(error|truncate)" in " ".join(shown.split())
    top = run_cli("--help").stdout
    assert "..." not in top.split("Commands:")[1]  # no description cut short
    # the root's help lists the commands without building them: as it reads with every command built
    assert top == run_cli("--cache-dir", "models", "--help").stdout == run_cli().stderr  # (bare: exit 2, on stderr)
    for command in ("chat", "list", "show", "bench", "config show"):
        assert "Examples:" in run_cli(*command.split(), "--help").stdout, command
    assert "JSON array" in run_cli("list", "--help").stdout and "finish reason" not in run_cli("show", "--help").stdout
    stray = run_cli("run", "-P", "2", "hi")
    assert stray.code == 2 and "--parallel applies to --batch" in stray.stderr


def test_completion_offers_the_choices_of_an_option():
    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        return run_cli(env={"_LLMCLI_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}).stdout.split()

    assert complete("llmcli run --speculate ") == ["auto", "lookup", "draft", "off"]
    assert complete("llmcli chat --kv-type q") == ["q8_0", "q4_0"]
    assert complete("llmcli run --reasoning s") == ["show", "stderr", "stdout"]
    assert complete("llmcli bench --format ") == ["md", "json", "csv"]
    assert complete("llmcli embed --format ") == ["jsonl", "npy"]


@pytest.mark.parametrize("shell, name", [("bash", "llmcli.bash"), ("zsh", "_llmcli"), ("fish", "llmcli.fish")])
def test_completion_scripts_match_the_app(shell, name, monkeypatch):
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = run_cli("--show-completion", shell)
    committed = (Path(__file__).parent.parent / "completions" / name).read_text()
    assert result.stdout == committed, f"completions/{name} is out of date: regenerate it (completions/README.md)"


def test_completion_offers_model_names_and_commands(tmp_path):
    env = {"_LLMCLI_COMPLETE": "complete_bash", "COMP_WORDS": "llmcli run -m smol", "COMP_CWORD": "3"}
    names = run_cli(env=env).stdout.split()
    assert "smollm2" in names and "smollm2-360m" in names
    config = tmp_path / "config.toml"
    config.write_text('[aliases]\nsmolly = "owner/repo:Q4_K_M"\n')
    names = run_cli(env={**env, "LLMCLI_CONFIG": str(config)}).stdout.split()
    assert "smolly" in names
    commands = run_cli(env={**env, "COMP_WORDS": "llmcli ch", "COMP_CWORD": "1"}).stdout.split()
    assert commands == ["chat"]


def test_extra_hints_follow_how_llmcli_was_installed(monkeypatch, tmp_path):
    from llmcli.config import install_hint as hints

    root = str(Path(__file__).resolve().parents[1])
    hint = hints.install_hint("serve")
    assert "'llmcli[serve]'" not in hint or root not in hint
    if hints._source()[0] is not None:  # installed from this clone (CI: pip install -e ".[dev]")
        assert f"{root}[serve]" in hint and "-e " in hint
    assert hint.split(" install ")[0] in ("pip", f"{sys.executable} -m pip")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    (tmp_path / "pipx_metadata.json").write_text("{}")  # what pipx writes beside each app's venv
    assert hints.install_hint("serve").startswith("pipx inject llmcli 'starlette>=")
    assert "uvicorn" in hints.install_hint("serve")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["bench", "--help"], ["config", "show", "--help"],
                                  ["ps", "--help"], ["logs", "--help"]])
def test_help_imports_neither_llama_cpp_nor_the_hub_nor_the_other_commands(args):
    """A command loads its own module alone (`llmcli ps` does not load bench, serve or the answer path), the root's
    help none of them, and help loads no llama.cpp, Hub or numpy."""
    code = (
        "import sys\n"
        f"sys.argv = ['llmcli', *{args!r}]\n"
        "from llmcli.cli import _COMMANDS, main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('llama_cpp', 'huggingface_hub', 'numpy') if m in sys.modules]\n"
        "commands = sorted({m for m, _, _ in _COMMANDS.values() if 'llmcli.cli.' + m in sys.modules})\n"
        "sys.stderr.write('HEAVY=' + ','.join(heavy) + ' COMMANDS=' + ','.join(commands))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Usage:" in proc.stdout
    heavy, commands = proc.stderr.strip().rsplit("\n", 1)[-1].split(" ")
    assert heavy == "HEAVY=", proc.stderr
    from llmcli.cli import _COMMANDS

    own = {_COMMANDS[args[0]][0]} if args[0] in _COMMANDS else set()  # the root's help lists names and lines only
    assert commands == "COMMANDS=" + ",".join(sorted(own))
