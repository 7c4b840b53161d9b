"""`llmcli run`: one prompt, one streamed answer (or many with --batch)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli import options as o
from llmcli.cli.tool_options import ToolOptions
from llmcli.errors import ExitCode, InvalidAnswer, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from llmcli.answer.answerer import Answerer
    from llmcli.answer.events import Done
    from llmcli.answer.images import ImageInput
    from llmcli.pipeline import Pipeline, Request
    from llmcli.tools.tool_loop import ToolRunner

PromptArg = Annotated[Optional[list[str]], typer.Argument(
    help="The prompt (several words are joined with spaces, as `ollama run` does: quotes are optional). With text piped "
    "in, the message is stdin, a blank line, then the prompt (--prompt-first reverses it). `-` or no prompt: stdin "
    "alone.", show_default=False)]
ShowPromptOpt = Annotated[bool, typer.Option("--show-prompt", help="Print the rendered prompt and its token count, then exit.",
                                             rich_help_panel=o.OUTPUT)]
INPUT, TEMPLATES = "Input and conversation", "Saved templates"
PromptFirstOpt = Annotated[bool, typer.Option("--prompt-first", help="Put the prompt argument before piped stdin "
                                              "(the order of earlier releases; a cached document is then not reused).",
                                              rich_help_panel=INPUT)]
WaitStdinOpt = Annotated[bool, typer.Option("--stdin", help="Wait for piped stdin however long it takes to start.",
                                            rich_help_panel=INPUT)]
BatchOpt = Annotated[Optional[str], typer.Option(
    "--batch", help='Answer many prompts: a file or `-`, one prompt per line or JSONL objects with a "prompt" field; '
    "JSONL out, in input order.", show_default=False, rich_help_panel="Batch")]
ParallelOpt = Annotated[Optional[int], typer.Option(
    "--parallel", "-P", min=1, max=64, rich_help_panel="Batch", show_default=False,
    help="With --batch: sequences decoded together in one context. [default: 4]")]
ContinueOpt = Annotated[bool, typer.Option(
    "--continue", "-C", help="Continue the most recent conversation in the log (a run's or a chat's): its exchanges "
    "come before the prompt. (-c is --ctx-size.)", rich_help_panel=INPUT)]
CidOpt = Annotated[Optional[str], typer.Option(
    "--cid", help="Continue this conversation (its id: llmcli logs --json).", show_default=False, rich_help_panel=INPUT)]
TemplateOpt = Annotated[Optional[str], typer.Option(
    "--template", "-T", help="Use a saved template: its system prompt, its prompt ($input: stdin and the prompt "
    "argument) and its settings (flags given still win). (-t is --threads.)", show_default=False,
    rich_help_panel=TEMPLATES)]
SaveOpt = Annotated[Optional[str], typer.Option(
    "--save", help="Save this command line as a template instead of running it: -s, the prompt (with $input and "
    "other $placeholders) and the settings given.", show_default=False, rich_help_panel=TEMPLATES)]
VarOpt = Annotated[Optional[list[str]], typer.Option(
    "--var", help="NAME=VALUE for a template's $NAME. Repeatable.", show_default=False, rich_help_panel=TEMPLATES)]
ImageOpt = Annotated[Optional[list[str]], typer.Option(
    "--image", "-i", help="Ask about an image (PNG, JPEG, GIF, WebP, BMP): a file, or `-` for one piped on stdin. "
    "Repeatable. The model needs its vision projector (found with it, or --mmproj).", show_default=False,
    rich_help_panel=INPUT)]
RayOpt = Annotated[bool, typer.Option(
    "--ray", help="With --batch: answer on a Ray cluster — $RAY_ADDRESS or --ray-address, else a local one of this "
    "machine's cores (needs the ray extra).", rich_help_panel="Batch")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", help="With --batch: the Ray cluster to answer on (HOST:6379, ray://HOST:10001); implies --ray.",
    show_default=False, rich_help_panel="Batch")]
RayWorkersOpt = Annotated[Optional[int], typer.Option(
    "--ray-workers", min=1, max=4096, show_default=False, rich_help_panel="Batch",
    help="With --ray: workers, each loading the model once on -t threads (1 unless given). [default: the cluster's "
    "CPUs / threads]")]
ResumeOpt = Annotated[Optional[Path], typer.Option(
    "--resume", help="With --batch: skip the records this earlier output (JSONL) already answers; append the rest "
    "to it: llmcli run --batch in.jsonl --resume out.jsonl >> out.jsonl", dir_okay=False, show_default=False,
    rich_help_panel="Batch")]
TraceOpt = Annotated[bool, typer.Option(
    "--trace", help="Show each step of the answer on stderr as it happens: the prompt as tokens (and where each part "
    "came from), the prefill, every token with its candidates as the model scored them and as the sampler left them "
    "(the stages that changed them), the stop and the summary. The model answers in this process.",
    rich_help_panel=o.OUTPUT)]
TraceTopOpt = Annotated[int, typer.Option("--trace-top", min=1, max=50, help="With --trace: candidates shown a token.",
                                          rich_help_panel=o.OUTPUT)]
TraceIdsOpt = Annotated[bool, typer.Option("--trace-ids", help="With --trace: each prompt token's id after its piece.",
                                           rich_help_panel=o.OUTPUT)]
TraceJsonOpt = Annotated[Optional[Path], typer.Option(
    "--trace-json", help="Write the trace to this file as JSON lines, one event a step (prompt, prefill, token…, stop, "
    "summary); implies --trace.", dir_okay=False, show_default=False, rich_help_panel=o.OUTPUT)]
DEFAULT_PARALLEL = 4


@dataclass(frozen=True)
class Message:
    """What run asks: the message, and the parts it came from (a piped document comes before the question)."""

    text: str
    prompt_arg: str | None = None
    stdin_text: str | None = None
    prompt_first: bool = False
    images: tuple[ImageInput, ...] = ()  # --image: pictures the message asks about (before its text)

    @property
    def stable(self) -> str:
        """What a later run likely shares: the piped document (before the question), else the whole message."""
        return self.stdin_text if self.stdin_text and self.prompt_arg and not self.prompt_first else self.text


@dataclass(frozen=True)
class RunOptions:
    """run's own options (those that are not settings), read once."""

    show_prompt: bool = False
    as_json: bool = False
    quiet: bool = False
    continue_conversation: bool = False
    cid: str | None = None
    trace: int | None = None  # --trace: candidates shown a token (None: no trace)
    trace_json: Path | None = None
    trace_ids: bool = False


def _variables(specs: list[str] | None) -> dict[str, str]:
    found = {}
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--var {spec!r}: expected NAME=VALUE")
        found[name] = value
    return found


def _save_template(name: str, prompt: str | None, request: Request, console: Console) -> None:
    from llmcli import paths
    from llmcli.config.saved_templates import PromptTemplate, save

    values = dict(request.settings)
    system = values.pop("system", None)
    save(PromptTemplate(name, system, prompt, values))
    console.print(f"saved template {name} in {paths.config_file()}: llmcli run -T {name} …")
    raise typer.Exit(ExitCode.OK)


@o.with_settings(tools=True)
def run(
    prompt: PromptArg = None,
    *,
    show_prompt: ShowPromptOpt = False,
    as_json: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    prompt_first: PromptFirstOpt = False,
    wait_stdin: WaitStdinOpt = False,
    batch: BatchOpt = None,
    parallel: ParallelOpt = None,
    continue_conversation: ContinueOpt = False,
    cid: CidOpt = None,
    template: TemplateOpt = None,
    save: SaveOpt = None,
    var: VarOpt = None,
    image: ImageOpt = None,
    ray: RayOpt = False,
    ray_address: RayAddressOpt = None,
    ray_workers: RayWorkersOpt = None,
    resume: ResumeOpt = None,
    trace: TraceOpt = False,
    trace_top: TraceTopOpt = 5,
    trace_ids: TraceIdsOpt = False,
    trace_json: TraceJsonOpt = None,
    request: Request,
    tools: ToolOptions,
) -> None:
    """Answer one prompt, streamed to stdout; stats on stderr."""
    from llmcli.cli import output
    from llmcli.cli.inputs import combine_input, read_images, read_message

    prompt_text = " ".join(prompt) if prompt else None  # (`llmcli run hello world`: one prompt of two words)

    if batch is not None:
        from llmcli.cli.batch import RayOptions, run_batch_command

        if prompt_text is not None:
            raise UsageError("--batch reads its prompts from the file; drop the prompt argument")
        if tools.used:
            raise UsageError("--batch answers without tools: drop --functions and --mcp")
        if image:
            raise UsageError('--batch reads each record\'s images from the file: {"prompt": "...", "images": ["a.png"]}')
        one_prompt = [flag for flag, given_here in (
            ("--show-prompt", show_prompt), ("--continue", continue_conversation), ("--cid", cid), ("--template", template),
            ("--save", save), ("--var", var), ("--prompt-first", prompt_first), ("--stdin", wait_stdin),
            ("--trace", trace or trace_json is not None)) if given_here]
        if one_prompt:  # (they shape one prompt of run's: a batch would answer without them)
            raise UsageError(f"--batch answers each record of its file on its own: drop {', '.join(one_prompt)}")
        n_parallel = parallel or DEFAULT_PARALLEL
        on_ray = RayOptions(ray_address, ray_workers) if ray or ray_address is not None else None
        from llmcli.pipeline import Shape

        run_batch_command(batch, replace(request, shape=Shape(n_parallel, batch=True)), n_parallel, quiet, on_ray, resume)
    if parallel is not None:
        raise UsageError("--parallel applies to --batch", hint="llmcli run --batch FILE --parallel N")
    if ray or ray_address is not None or ray_workers is not None or resume is not None:
        raise UsageError("--ray, --ray-address, --ray-workers and --resume apply to --batch",
                         hint="llmcli run --batch FILE --ray")
    if request.settings.get("logprobs") is not None and not as_json:
        raise UsageError("--logprobs is part of the JSON record: add --json", hint='llmcli run --json --logprobs 3 "…"')
    console = output.stderr_console()
    if save is not None:
        _save_template(save, prompt_text, request, console)
    chosen = None
    if template is not None:
        from llmcli.config.saved_templates import load

        chosen = load(template)
        settings = {**chosen.settings, **request.settings}  # (flags given still win)
        if chosen.system and not request.settings.get("system"):
            settings["system"] = chosen.system
        request = replace(request, settings=settings)
    images = read_images(image)
    if "-" in (image or []):  # stdin held the image: the prompt is the argument alone
        if prompt_text in (None, "-"):
            raise UsageError("--image - reads stdin: give the question as the prompt argument")
        message = Message(chosen.render(prompt_text, _variables(var)) if chosen is not None else prompt_text or "",
                          prompt_text, images=images)
    elif chosen is not None and not chosen.needs_input and prompt_text is None and (sys.stdin is None or sys.stdin.isatty()):
        message = Message(chosen.render(None, _variables(var)), images=images)
    else:
        prompt_arg, stdin_text, notice = read_message(prompt_text, wait_stdin)
        if notice and not quiet:
            output.print_notice(console, notice)
        text = combine_input(prompt_arg, stdin_text, prompt_first)
        message = Message(chosen.render(text, _variables(var)) if chosen is not None else text, prompt_arg, stdin_text,
                          prompt_first, images)
    if tools.used and (request.grammar or request.grammar_file or request.json_schema or request.output_format):
        raise UsageError("tools constrain the answer themselves: drop --grammar, --json-schema, --format")
    tracing = trace or trace_json is not None
    if tracing:
        _traced(request, tools)
    options = RunOptions(show_prompt, as_json, quiet, continue_conversation, cid, trace_top if tracing else None,
                         trace_json, trace_ids)
    runner = tools.runner(console)
    with contextlib.ExitStack() as stack:
        if runner is not None:
            stack.enter_context(runner)  # MCP servers stop when the run ends, however it ends
        _answer(message, options, request, runner, console)


def _traced(request: Request, tools: ToolOptions) -> None:
    """--trace: refused where no sampler llmcli runs can be read (in this process, or a warm server's)."""
    from llmcli.config import settings

    if tools.used:
        raise UsageError("--trace traces one answer: drop --functions and --mcp")
    if settings.resolve(request.settings, request.profile)["endpoint"]:
        raise UsageError("--trace reads llmcli's own sampler: --endpoint's server samples on its own")


def _show_prompt(pipeline: Pipeline[Answerer], request: Request, message: Message, runner: ToolRunner | None,
                 console: Console) -> None:
    """The prompt as the model will see it (the conversation continued, the tools), and its token count."""
    from llmcli.pipeline import shown_prompt

    shown = shown_prompt(pipeline, request, message.text, runner.spec(first=True) if runner is not None else None,
                         message.images)
    sys.stdout.write(shown.rendered.text + "\n")
    mode = "chat template" if shown.templated else "raw"
    console.print(f"{len(shown.rendered.tokens)} tokens ({pipeline.model.name}, {mode}, context {shown.n_ctx})")


def _answer(message: Message, options: RunOptions, request: Request, runner: ToolRunner | None,
            console: Console) -> None:
    from llmcli.chat.conversation import Conversation
    from llmcli.cli import output
    from llmcli.cli.stream import AnswerSink, show_answer
    from llmcli.pipeline import continued, log_entry, prompt_text
    from llmcli.tools.tool_loop import cut_off as tool_call_cut_off

    with output.open_pipeline(request, console, runner) as pipeline:
        session = pipeline.session
        if runner is not None:  # (--tools-debug's prompt after the results: this process's, or the warm server's)
            runner.render_prompt = prompt_text(pipeline, request)
        conversation = Conversation(session, pipeline.generation, pipeline.model.name, pipeline.model.path,
                                    save=pipeline.settings["log"], pinned=pipeline.settings.chosen_now(),
                                    served=pipeline.served)
        if pipeline.settings["log"]:
            conversation.log = lambda text, answer, added: log_entry(
                pipeline, "run", text, answer, conversation.generation, conversation.id, added)
        if options.continue_conversation or options.cid:  # its exchanges (tool calls too), system prompt, /set changes
            conversation.id, records = continued(options.cid)
            conversation.replay(records)
        generation = conversation.generation
        if options.show_prompt:
            _show_prompt(pipeline, request, message, runner, console)
            return
        sink = AnswerSink(as_json=options.as_json, extra={"model": pipeline.model.name},
                          reasoning=pipeline.settings["reasoning"], markdown=pipeline.settings["markdown"],
                          color=pipeline.settings["answer_color"])
        start = len(session.history)
        view = None
        if options.trace is not None:
            from llmcli.cli.trace_view import open_trace

            view = open_trace(pipeline, request, message.text, message.images, options.trace, console,
                              options.trace_json, options.trace_ids)
            generation = replace(generation, trace=options.trace)

        def logged(done: Done) -> None:  # in the answer log, and in the conversation's record for run -C
            warning = conversation.record_exchange(message.text, done, start)
            failure = conversation.take_save_failure()  # (the same database: one warning says it)
            if warning or failure:
                output.print_notice(console, warning or failure or "")
            if conversation.answer_id is not None:  # --json says where the answer is: `llmcli logs`' id, and the id
                sink.extra.update(log_id=conversation.answer_id, conversation_id=conversation.id)  # run --cid continues

        with pipeline.cancel.on_signals():
            if runner is not None:
                from llmcli.tools.tool_loop import answer_with_tools

                events = answer_with_tools(session, message.text, generation, runner, pipeline.cancel, message.stable,
                                           message.images)
            else:
                events = session.ask(message.text, generation, stable_text=message.stable, images=message.images)
            try:
                done = show_answer(events, sink, console, options.quiet, logged, view)
            finally:
                if view is not None and view.json_out is not None:
                    view.json_out.close()
        format_error = done.format_error if done is not None else None
        call_cut = runner is not None and done is not None and tool_call_cut_off(done)
        signum = pipeline.cancel.signum
    if signum is not None:
        raise typer.Exit(128 + signum)
    if call_cut:  # (its notice said so): an answer its limit cut, as a --json-schema answer cut off
        raise typer.Exit(ExitCode.INVALID_ANSWER)
    if format_error is not None:
        raise InvalidAnswer(format_error, hint="Raise -n, or simplify the schema; --json records the reason.")
    raise typer.Exit(ExitCode.OK)

