"""`llmcli run`: one prompt, one streamed answer."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from llmcli.cli import options as o
from llmcli.cli.inputs import read_message
from llmcli.errors import ExitCode, UsageError


def setting_flags(given: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line, by setting name (an empty --stop list is 'not given')."""
    from llmcli.settings import SETTINGS

    return {name: given[name] for name in SETTINGS if given.get(name) not in (None, [])}


def run(
    prompt: Annotated[
        Optional[str],
        typer.Argument(
            help="The prompt. With text piped in, the message is the prompt, a blank line, then stdin "
            "(--stdin-first reverses it). `-` or no prompt: stdin alone.",
            show_default=False,
        ),
    ] = None,
    model: o.ModelOpt = None,
    offline: o.OfflineOpt = False,
    force: o.ForceOpt = False,
    profile: o.ProfileOpt = None,
    system: o.SystemOpt = None,
    raw: o.RawOpt = False,
    chat_template_file: o.TemplateFileOpt = None,
    show_prompt: Annotated[bool, typer.Option("--show-prompt", help="Print the rendered prompt and its token count, then exit.")] = False,
    temp: o.TempOpt = None,
    top_k: o.TopKOpt = None,
    top_p: o.TopPOpt = None,
    min_p: o.MinPOpt = None,
    typical_p: o.TypicalPOpt = None,
    repeat_penalty: o.RepeatPenaltyOpt = None,
    repeat_last_n: o.RepeatLastNOpt = None,
    presence_penalty: o.PresencePenaltyOpt = None,
    frequency_penalty: o.FrequencyPenaltyOpt = None,
    mirostat: o.MirostatOpt = None,
    mirostat_tau: o.MirostatTauOpt = None,
    mirostat_eta: o.MirostatEtaOpt = None,
    seed: o.SeedOpt = None,
    logit_bias: o.LogitBiasOpt = None,
    max_tokens: o.MaxTokensOpt = None,
    stop: o.StopOpt = None,
    grammar: o.GrammarOpt = None,
    grammar_file: o.GrammarFileOpt = None,
    json_schema: o.JsonSchemaOpt = None,
    output_format: o.FormatOpt = None,
    on_overflow: o.OnOverflowOpt = None,
    ctx_size: o.CtxSizeOpt = None,
    threads: o.ThreadsOpt = None,
    batch_size: o.BatchSizeOpt = None,
    mlock: o.MlockOpt = None,
    mmap: o.MmapOpt = None,
    verbose: o.VerboseOpt = False,
    as_json: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    stdin_first: Annotated[bool, typer.Option("--stdin-first", help="Put piped stdin before the prompt argument.")] = False,
    wait_stdin: Annotated[bool, typer.Option("--stdin", help="Wait for piped stdin however long it takes to start.")] = False,
    batch: Annotated[Optional[str], typer.Option("--batch", help="Answer many prompts: a file or `-`, one prompt per line or JSONL objects with a \"prompt\" field; JSONL out, in input order.", show_default=False)] = None,
    parallel: Annotated[int, typer.Option("--parallel", "-P", min=1, max=64, help="With --batch: sequences decoded together in one context.")] = 4,
) -> None:
    """Answer one prompt, streamed to stdout; stats on stderr."""
    from llmcli import render
    from llmcli.engine import Done
    from llmcli.pipeline import Request, open_pipeline
    from llmcli.session import Notice, combine_input

    if batch is not None:
        from llmcli.cli.batch import run_batch_command

        if prompt is not None:
            raise UsageError("--batch reads its prompts from the file; drop the prompt argument")
        request = Request(setting_flags(locals()), profile, raw, chat_template_file, tuple(logit_bias or ()),
                          grammar, grammar_file, json_schema, output_format, verbose, offline, force, parallel)
        run_batch_command(batch, request, parallel, quiet)
    console = render.stderr_console()
    prompt_arg, stdin_text, notice = read_message(prompt, wait_stdin)
    if notice and not quiet:
        render.print_notice(console, notice)
    message = combine_input(prompt_arg, stdin_text, stdin_first)
    request = Request(
        setting_flags(locals()), profile, raw, chat_template_file, tuple(logit_bias or ()),
        grammar, grammar_file, json_schema, output_format, verbose, offline, force,
    )
    with render.download_progress() as progress:  # shown only if the model must be downloaded first
        pipeline = open_pipeline(request, progress)
    with pipeline:
        for text in pipeline.session.notices:
            render.print_notice(console, text)
        if show_prompt:
            rendered = pipeline.session.render(message)
            sys.stdout.write(rendered.text + "\n")
            mode = "raw" if pipeline.session.raw else "chat template"
            console.print(f"{len(rendered.tokens)} tokens ({pipeline.model.name}, {mode}, context {pipeline.engine.n_ctx})")
            return
        sink = render.AnswerSink(as_json=as_json, extra={"model": pipeline.model.name})
        with pipeline.cancel.on_signals():
            for event in pipeline.session.ask(message, pipeline.generation):
                if isinstance(event, Notice):
                    sink.notices.append(event.text)
                    render.print_notice(console, event.text)
                    continue
                sink.handle(event)
                if isinstance(event, Done) and not quiet:
                    render.print_stats(console, event)
        signum = pipeline.cancel.signum
    if signum is not None:
        raise typer.Exit(128 + signum)
    raise typer.Exit(ExitCode.OK)
