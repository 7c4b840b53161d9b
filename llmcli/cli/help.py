"""Help that is easy to scan: options grouped in panels (in plain text too), and examples per command.

Typer shows `rich_help_panel` groups only when it renders help with rich; llmcli keeps plain help (fast,
and usage errors stay one `Error:` line), so the grouping is done here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from typer.core import TyperCommand

from llmcli.config.settings import CACHE, DOWNLOADS, ENGINE, MODEL, OUTPUT, REMOTE, SAMPLING, TOOLS

if TYPE_CHECKING:
    from typer._click.core import Context  # (the click that Typer carries, and calls these with)
    from typer._click.formatting import HelpFormatter
    from typer.core import TyperOption

# Panels in the order a reader looks for them; any other panel follows, in the order it appears.
PANEL_ORDER = (MODEL, "Input and conversation", "Saved conversations", SAMPLING, "Constrained output", TOOLS, OUTPUT,
               "Batch", "Saved templates", ENGINE, CACHE, REMOTE, DOWNLOADS, "Server", "Options")

# What `-h` shows (`--help` shows everything): the options most command lines use.
ESSENTIAL = frozenset({
    "--model", "--system", "--temp", "--max-tokens", "--stop", "--seed", "--json-schema", "--format", "--json",
    "--quiet", "--show-prompt", "--batch", "--parallel", "--continue", "--template", "--resume", "--ctx-size",
    "--threads", "--endpoint", "--host", "--port", "--api-key", "--help",
})


class PanelledCommand(TyperCommand):
    """Arguments, then the options panel by panel, in the order the command declares them. `-h` shows the
    essential ones (and how many more `--help` shows), `--help` every one."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        before = args[: args.index("--")] if "--" in args else args
        ctx.meta["llmcli.short_help"] = "-h" in before and "--help" not in before
        return list(super().parse_args(ctx, args))

    def get_help_option(self, ctx: Context) -> TyperOption | None:
        option = super().get_help_option(ctx)
        if option is not None:
            option.help = "-h: the main options; --help: all of them."
        return option

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        short = bool(ctx.meta.get("llmcli.short_help"))
        arguments: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        left_out = 0
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            elif short and not ESSENTIAL & set(param.opts):
                left_out += 1
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        ordered = sorted(panels, key=lambda p: PANEL_ORDER.index(p) if p in PANEL_ORDER else len(PANEL_ORDER))
        for panel in ordered:
            records = panels[panel]
            with formatter.section(panel):
                formatter.write_dl(records)
        if left_out:
            formatter.write_paragraph()
            formatter.write_text(f"{left_out} more options (sampling, engine, cache, output): "
                                 f"llmcli {ctx.info_name} --help")


def examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (`\\b` stops the reflow)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLES = {
    "run": examples(
        'llmcli run "Why is the sky blue?"',
        'llmcli run --temp 0 -n 64 --stop "\\n\\n" "Name three planets."',
        'cat report.md | llmcli run "What are the three main risks?"',
        'llmcli run --json-schema schema.json "Describe Paris."',
        "llmcli run --batch questions.txt --parallel 8 > answers.jsonl",
        'llmcli run -m gemma3-270m --raw -n 64 "Once upon a time"',
        'llmcli run -C "And why?"                # continue the last conversation',
        "cat notes.md | llmcli run -T summarize  # a saved template",
    ),
    "chat": examples("llmcli chat", 'llmcli chat -s "Answer in French." --temp 0.3', "llmcli chat --resume last",
                     "llmcli chat --list"),
    "pull": examples("llmcli pull bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M", "llmcli pull qwen2.5-0.5b"),
    "list": examples("llmcli list", "llmcli list --all", "llmcli list --json | jq '.[].name'", "llmcli list --available"),
    "show": examples("llmcli show smollm2", "llmcli show --template smollm2", "llmcli show --json OWNER/REPO:Q4_K_M"),
    "rm": examples("llmcli rm -y bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M", "llmcli rm gemma3-270m"),
    "verify": examples("llmcli verify", "llmcli verify OWNER/REPO"),
    "prune": examples("llmcli prune"),
    "bench": examples("llmcli bench", "llmcli bench -m smollm2 -m gemma3-270m -t 1,2 --parallel 1,8",
                      "llmcli bench --contention", "llmcli bench --prompt-cache 512,2048 --kv-type f16,q8_0",
                      "llmcli bench --speculate -n 256", "llmcli bench --tune --budget 2m --save fast",
                      "llmcli bench --format json > a.json && llmcli bench compare a.json b.json"),
    "serve": examples("llmcli serve", "llmcli serve -m smollm2 --parallel 8 --port 8080",
                      "LLMCLI_API_KEY=secret llmcli serve --host 0.0.0.0",
                      "curl -N localhost:8080/v1/chat/completions -H 'Content-Type: application/json' "
                      '-d \'{"stream":true,"messages":[{"role":"user","content":"hi"}]}\''),
    "count": examples("llmcli count report.md notes.md", "cat report.md | llmcli count -m gemma3-270m",
                      'llmcli count --chat -s "Be brief." "What is a token?"', "llmcli count --json *.md | jq .total"),
    "embed": examples('llmcli embed "some text"', "llmcli embed --input notes.jsonl --field text > vectors.jsonl",
                      "cat lines.txt | llmcli embed --format npy > v.npy"),
    "similar": examples('llmcli similar --collection vectors.jsonl "query" -n 5'),
    "ps": examples("llmcli ps", "llmcli ps --json"),
    "launch": examples("llmcli launch claude -m gemma3-270m", "llmcli launch codex -m gemma3-270m -- exec 'list the files'",
                       "llmcli launch aider --config"),
    "stop": examples("llmcli stop", "llmcli stop smollm2"),
    "logs": examples("llmcli logs", 'llmcli logs -q "lighthouse" --json', "llmcli logs -m smollm2 --since 7d",
                     "llmcli logs rm --before 30d", "llmcli logs off"),
    "tokenize": examples('llmcli tokenize "Hello world"', 'llmcli tokenize --json "Hello world"',
                         'llmcli tokenize --chat "Hi"'),
    "eval": examples("pip install --no-deps bfcl-eval   # BFCL's items (its data alone)",
                     "llmcli eval tools -m smollm2", "llmcli eval tools simple irrelevance --tool-choice required -l 50",
                     "llmcli eval tools --items mine.json --answers mine-answers.json --json"),
    "quantize": examples("llmcli quantize smollm2 --type Q8_0 --allow-requantize   # -> smollm2:q8_0",
                         "llmcli quantize ./model-f16.gguf --type Q4_K_M -o model-q4_k_m.gguf",
                         "llmcli run -m smollm2:q8_0 \"Hello\""),
    "quant": examples("llmcli quant advise -m smollm2 --make Q8_0,Q4_K_M,Q4_0 --allow-requantize",
                      "llmcli quant advise -m bartowski/Llama-3.2-1B-Instruct-GGUF --max-memory 2G --min-decode 20",
                      "llmcli quant advise --json | jq .pick"),
    "mcp": examples("llmcli mcp list", "llmcli mcp list --mcp ~/.cursor/mcp.json --json",
                    "llmcli mcp call files read_file '{\"path\": \"/tmp/notes.txt\"}'",
                    'llmcli run --mcp-server files "What is in /tmp/notes.txt?"'),
    "cache list": examples("llmcli cache list", "llmcli cache list --json | jq '.[].tokens'"),
    "cache info": examples("llmcli cache info", "llmcli --cache-dir /big/disk cache info"),
    "cache clear": examples("llmcli cache clear"),
    "config show": examples("llmcli config show", "llmcli config show -p coder --temp 0.2 --json"),
}

SHORT_HELP = {
    "run": "Answer one prompt (or a --batch of them), streamed to stdout.",
    "chat": "Talk with a model; only each new turn is prefilled.",
    "pull": "Download a model into the cache.",
    "list": "Installed and cached models (--all: Ollama's, LM Studio's too).",
    "show": "A model's metadata, without loading its weights.",
    "rm": "Remove a cached model.",
    "verify": "Re-hash cached models against their sha256.",
    "prune": "Remove partial downloads of killed processes.",
    "bench": "Prefill/decode speed, TTFT, overhead, contention.",
    "config": "The effective settings and where each comes from.",
    "cache": "The prompt cache: saved KV states (list, info, clear).",
    "serve": "A server for other programs: the OpenAI, Anthropic and Ollama APIs and a chat page (--parallel slots).",
    "count": "Count tokens of files or a prompt (only the vocabulary is loaded).",
    "embed": "Embed texts: vectors as JSON, JSONL or .npy (many texts a pass).",
    "similar": "The stored texts nearest to a query (cosine).",
    "templates": "Saved prompt templates: list, show, edit, rm (run -T NAME).",
    "logs": "Every answer, recorded: list, search, remove (SQLite).",
    "tokenize": "Show the tokens of a text: ids and pieces.",
    "mcp": "MCP servers: their tools (list), one call (call).",
    "eval": "How well a model calls tools (eval tools); how far a quant is from its reference (eval quality).",
    "quant": "Which quant to run here: speed, memory and quality measured, one picked (quant advise).",
    "quantize": "Make a GGUF of another quantization type (llama.cpp's quantizer): into the store or -o.",
    "ps": "The warm servers of --keep-alive and launch: model, memory, when each exits.",
    "launch": "Run a coding agent (Claude Code, Codex, OpenCode, aider) on a local model.",
    "stop": "End warm servers (--keep-alive, launch): one model's, or every one.",
}
