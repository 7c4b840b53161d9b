"""`llmcli run`: one prompt, one streamed answer."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llmcli.cli import options as o
from llmcli.cli.inputs import read_message
from llmcli.errors import ExitCode


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
    system: o.SystemOpt = None,
    raw: o.RawOpt = False,
    chat_template_file: o.TemplateFileOpt = None,
    show_prompt: Annotated[bool, typer.Option("--show-prompt", help="Print the rendered prompt and its token count, then exit.")] = False,
    temp: o.TempOpt = 0.8,
    seed: o.SeedOpt = None,
    max_tokens: o.MaxTokensOpt = None,
    stop: o.StopOpt = None,
    ctx_size: o.CtxSizeOpt = None,
    threads: o.ThreadsOpt = None,
    batch_size: o.BatchSizeOpt = 512,
    as_json: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    verbose: o.VerboseOpt = False,
    stdin_first: Annotated[bool, typer.Option("--stdin-first", help="Put piped stdin before the prompt argument.")] = False,
    wait_stdin: Annotated[bool, typer.Option("--stdin", help="Wait for piped stdin however long it takes to start.")] = False,
) -> None:
    """Answer one prompt, streamed to stdout; stats on stderr."""
    from llmcli import models, render
    from llmcli.engine import Cancellation, Done, Engine, EngineConfig
    from llmcli.sampling import SamplingConfig
    from llmcli.session import GenerationOptions, PromptOptions, Session, combine_input

    console = render.stderr_console()
    prompt_arg, stdin_text, notice = read_message(prompt, wait_stdin)
    if notice and not quiet:
        render.print_notice(console, notice)
    message = combine_input(prompt_arg, stdin_text, stdin_first)
    generation = GenerationOptions(SamplingConfig(temperature=temp, seed=seed), max_tokens, tuple(stop or ()))
    resolved = models.resolve(model)
    cancel = Cancellation()
    with Engine(resolved.path, EngineConfig(ctx_size, threads, batch_size, verbose), cancel) as engine:
        session = Session(engine, PromptOptions(system, raw, chat_template_file))
        for text in session.notices:
            render.print_notice(console, text)
        if show_prompt:
            rendered = session.render(message)
            sys.stdout.write(rendered.text + "\n")
            console.print(f"{len(rendered.tokens)} tokens ({resolved.name}, {'raw' if session.raw else 'chat template'})")
            return
        sink = render.AnswerSink(as_json=as_json, extra={"model": resolved.name})
        with cancel.on_signals():
            for event in session.ask(message, generation):
                sink.handle(event)
                if isinstance(event, Done) and not quiet:
                    render.print_stats(console, event)
    if cancel.signum is not None:
        raise typer.Exit(128 + cancel.signum)
    raise typer.Exit(ExitCode.OK)
