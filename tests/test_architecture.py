"""The architecture is checked, not only described: the import contract (pyproject's [tool.importlinter],
run by `lint-imports`), the engine's privacy, module sizes, and settings declared once."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from llmcli.config.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmcli"
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the `llmcli` package under `root` (the working directory comes first on its path)."""
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)})


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package and its contract, to break on purpose."""
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(PACKAGE, root / "llmcli", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_import_contract_holds():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 13 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, added, broken", [
    ("config/settings.py", "import llama_cpp", "llama_cpp only in llmcli.llama and the bench's raw baseline BROKEN"),
    ("answer/stats.py", "import llmcli.llama.vocab", "The answer logic imports no llama_cpp, not even indirectly BROKEN"),
    ("remote/client.py", "import numpy", "--endpoint imports neither llama_cpp nor numpy, not even indirectly BROKEN"),
    ("chat/conversation.py", "import llmcli.remote.session", "Layers: the CLI over serve"),
    ("paths.py", "import llmcli.units", "Layers: the CLI over serve"),
    ("store/models.py", "import huggingface_hub", "huggingface_hub and filelock only in llmcli.store.hub BROKEN"),
    ("llama/engine.py", "import rich", "typer, click and rich only in llmcli.cli BROKEN"),
    ("store/models.py", "import llmcli.cli.output", "Layers: the CLI over serve"),
    ("store/cache.py", "import llmcli.store.catalog", "No import cycles between sibling modules BROKEN"),
    ("answer/generation.py", "import llmcli.store.cache", "Layers: the CLI over serve"),  # the stores over the answer logic
    ("tools/tool_loop.py", "import llmcli.chat.conversation", "Layers: the CLI over serve"),  # a conversation over its tools
    ("tools/tool_loop.py", "import mcp", "mcp (the SDK, the mcp extra) only in llmcli.tools.mcp_servers BROKEN"),
    ("llama/vision.py", "import PIL", "PIL (Pillow) only in llmcli.answer.image_bytes"),
    ("decode/batch_run.py", "import ray", "ray (the ray extra) only in llmcli.cluster"),
])
def test_a_forbidden_import_breaks_the_contract(tree_copy: Path, module: str, added: str, broken: str):
    target = tree_copy / "llmcli" / module
    original = target.read_text()
    target.write_text(f"{added}  # a forbidden import, added by the test\n{original}")
    try:
        result = lint_imports(tree_copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


def test_only_the_engine_touches_its_private_parts():
    pattern = re.compile(r"engine\._|\._ctx\b|\._vocab\b|\._memory\b")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in PACKAGE.rglob("*.py") if path.name not in ("engine.py", "kv_cache.py")
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_every_module_sits_in_a_layer_of_the_contract(tree_copy: Path):
    """The layers contract is exhaustive: a new top-level module or package in no layer breaks it."""
    added = tree_copy / "llmcli" / "unlayered.py"
    added.write_text('"""A module in no layer, added by the test."""\n')
    try:
        result = lint_imports(tree_copy)
    finally:
        added.unlink()
    assert result.returncode != 0
    assert "unlayered" in result.stdout, result.stdout


def test_llama_decode_is_called_from_the_engine_and_the_bench_baseline_only():
    callers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "llama_cpp.llama_decode" in p.read_text())
    assert callers == ["bench/baseline_loop.py", "llama/engine.py"]


def test_one_preparation_serves_every_path():
    """Issue 57: an answer was prepared in three places (run's and chat's session, --batch, serve — and so every warm
    run), each fitting the prompt and capping -n its own way. The rules are called in llmcli/answer/preparation.py
    alone, and its `prepare` by the session (run, chat, --batch) and serve."""
    rules = re.compile(r"\b(capped|truncated|truncation_notice)\(|\.for_(turn|prompt)\(")
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if rules.search(p.read_text())
                   and p.name != "context_budget.py")
    assert users == ["answer/preparation.py"]
    callers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "preparation.prepare(" in p.read_text())
    assert callers == ["chat/session.py", "serve/answer_request.py"]


def test_every_setting_is_an_option_of_run_chat_and_config_show_with_its_default():
    for command in ("run", "chat", "config show"):
        result = run_cli(*command.split(), "--help")
        assert result.code == 0, result.stderr
        shown = " ".join(result.stdout.split())  # help text is wrapped
        for setting in SETTINGS.values():
            for flag in (part for flags in setting.flags for part in flags.split("/")):
                assert flag in shown, (command, flag)
            assert f"[default: {setting.shown_default()}; env {setting.env}]" in shown, (command, setting.name)


def test_config_show_and_chat_set_come_from_the_table(tmp_path):
    unset = {"LLMCLI_THREADS": "", "LLMCLI_KEEP_ALIVE": "", "LLMCLI_MODEL": ""}  # (the tests' own settings)
    shown = run_cli("config", "show", "--json", env=unset)
    assert shown.code == 0, shown.stderr
    record = json.loads(shown.stdout)["settings"]
    table = run_cli("config", "show", env=unset).stdout
    assert table.splitlines()[1].split() == ["SETTING", "VALUE", "SOURCE"] and not any(c in table for c in "┃━│")
    assert list(record) == list(SETTINGS)
    assert {name: entry["value"] for name, entry in record.items() if entry["source"] == "default"} == {
        name: s.default for name, s in SETTINGS.items()}
    chat_help = run_cli("chat", "-q", "--no-save", input="/help\n")
    block = chat_help.stderr.split("/set NAME VALUE", 1)[1].split("/show", 1)[0]
    listed = block.split(":", 1)[1].replace("\n", " ").split(", ")
    assert [name.strip() for name in listed] == [name for name, s in SETTINGS.items() if s.chat]


def test_the_readme_lists_every_module():
    built = (ROOT / "README.md").read_text().split("## How it is built", 1)[1].split("\n## ", 1)[0]
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and f"{p.name}" not in built]
    assert missing == []


def test_the_answerer_is_narrow_and_every_answerer_has_all_of_it():
    """`Answerer` is what every model answers through; what only a local model can do is its optional `local` part. The
    remote answerer has none of the local part, and the warm fallback forwards each member by name (no __getattr__)."""
    from llmcli.answer.answerer import Answerer, LocalModel
    from llmcli.chat.session import Session
    from llmcli.pipeline.fallback import FallbackAnswerer
    from llmcli.remote.session import RemoteSession

    def members(protocol: type) -> set[str]:
        return {name for name in vars(protocol) if not name.startswith("_")} | set(protocol.__annotations__)

    answering, local = members(Answerer), members(LocalModel)
    assert answering == {"options", "history", "notices", "not_sent", "where", "local", "ask", "batch"}  # (≤ 8: issue 57)
    assert not answering & local
    for implementation in (Session, RemoteSession, FallbackAnswerer):
        assert "__getattr__" not in vars(implementation)
        given = set(dir(implementation)) | set(getattr(implementation, "__annotations__", {}))
        assert answering - {"options", "history", "notices"} <= given, implementation  # (instance attributes)
    assert local <= set(dir(Session))
    assert not local & set(dir(RemoteSession)) and RemoteSession.local is None


def test_top_level_help_says_what_each_command_is():
    shown = " ".join(run_cli("--help").stdout.split())  # (its lines wrap)
    assert "OpenAI, Anthropic and Ollama APIs and a chat page" in shown  # (not "an OpenAI-compatible server")
    assert "eval How well a model calls tools" in shown


def test_the_cli_never_asks_whether_the_model_is_local():
    """Issue 57: what differs between a model in this process and a server (rendering --show-prompt, the context,
    the KV state kept for --resume) is the core's to decide (llmcli.pipeline.shown_prompt, Conversation): no command
    reads `.local`."""
    switches = [f"{path.relative_to(PACKAGE)}:{number}" for path in (PACKAGE / "cli").glob("*.py")
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if "import" not in line and (".local " in line or ".local." in line or line.rstrip().endswith(".local"))]
    assert switches == []


def test_few_loose_modules_at_the_top():
    """Issue 57: at most six modules loose at the package's top (the ground floor); the rest live in their step's
    package."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 6, loose


def test_the_cli_glue_is_typed():
    """Issue 57: a command gets what its options say as a typed Request (and ToolOptions), never `**given: Any` read
    by string key, so mypy checks every use; `Any` is kept for what is JSON or Typer's own (at most 30 in cli/)."""
    sources = {path.relative_to(PACKAGE): path.read_text() for path in (PACKAGE / "cli").glob("*.py")}
    assert [str(path) for path, text in sources.items() if re.search(r"\*\*given|given\[[\"']", text)] == []
    uses = sum(len(re.findall(r"\bAny\b", text)) for text in sources.values())
    assert uses <= 30, f"{uses} `Any` in llmcli/cli"
