"""`llmcli count` and `llmcli tokenize`: a model's tokens for some text, from its vocabulary alone (no weights)."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli import options as o
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.pipeline import Request
    from llmcli.pipeline.local import Tokenizer

SETTINGS_TAKEN = ("model", "system", "ctx_size", "think", "mmproj")  # what changes a prompt's tokens or the context
ChatOpt = Annotated[bool, typer.Option(
    "--chat", help="Count the rendered chat prompt of the text as one message (chat template and system prompt), as "
    "`run` sends it; without it, the text as-is (as `run --raw`).")]
CountJsonOpt = Annotated[bool, typer.Option(
    "--json", help='Print {"total", "context", "fits", "files": [{"name", "tokens"}]} on stdout.', rich_help_panel=o.OUTPUT)]
TokenizeJsonOpt = Annotated[bool, typer.Option(
    "--json", help='Print {"ids": [...], "pieces": [...]} on stdout.', rich_help_panel=o.OUTPUT)]
FilesArg = Annotated[Optional[list[str]], typer.Argument(
    help="Text files to count (`-` or none: stdin; one argument that names no file: that text). With --chat: the "
    "prompt, as `run` takes it.", show_default=False)]
ImageOpt = Annotated[Optional[list[str]], typer.Option(
    "--image", "-i", help="Count with an image (as `run --image`: the model's projector says how many tokens it "
    "takes). Repeatable; `-`: piped on stdin.", show_default=False)]
TextArg = Annotated[Optional[str], typer.Argument(help="The text (`-` or none: stdin).", show_default=False)]


@o.with_settings(request=False, only=SETTINGS_TAKEN)
def count(
    files: FilesArg = None,
    *,
    chat: ChatOpt = False,
    chat_template_file: o.TemplateFileOpt = None,
    offline: o.OfflineOpt = False,
    as_json: CountJsonOpt = False,
    image: ImageOpt = None,
    request: Request,
) -> None:
    """Count tokens: per file and in total, against the context size; only the vocabulary is loaded."""
    from llmcli.cli import output
    from llmcli.cli.inputs import read_images

    _check_chat_only(request, chat, chat_template_file)
    images = read_images(image)
    if "-" in (image or []) and not files:
        raise UsageError("--image - reads stdin: give the text as an argument")
    inputs = _inputs(files, chat) if files or not images else [("prompt", "")]
    with _tokenizer(request, chat, chat_template_file, offline) as tokenizer:
        counted = [(name, len(tokenizer.chat(text, images).tokens if chat else tokenizer.raw(text, images)))
                   for name, text in inputs]
        _notices(tokenizer, chat)
    total = sum(n for _, n in counted)
    fits = total <= tokenizer.n_ctx
    if as_json:
        output.print_json({"total": total, "context": tokenizer.n_ctx, "fits": fits,
                           "files": [{"name": name, "tokens": n} for name, n in counted]})
        return
    if len(counted) == 1:
        print(total)
    else:
        width = len(str(total))
        for name, n in counted:
            print(f"{n:>{width}}  {name}")
        print(f"{total:>{width}}  total")
    verdict = f"fits ({tokenizer.n_ctx - total} left)" if fits else f"does not fit ({total - tokenizer.n_ctx} over)"
    output.stderr_console().print(f"{total} tokens ({tokenizer.model.name}, "
                                  f"{'chat prompt' if chat and tokenizer.template else 'as-is'}), "
                                  f"context {tokenizer.n_ctx}: {verdict}",
                                  style="dim")


@o.with_settings(request=False, only=SETTINGS_TAKEN)
def tokenize(
    text: TextArg = None,
    *,
    chat: ChatOpt = False,
    chat_template_file: o.TemplateFileOpt = None,
    offline: o.OfflineOpt = False,
    as_json: TokenizeJsonOpt = False,
    request: Request,
) -> None:
    """Show the tokens of a text: id and piece (bytes that are not UTF-8 as \\xNN); only the vocabulary is loaded."""
    from llmcli.cli import output

    _check_chat_only(request, chat, chat_template_file)
    ((_, message),) = _inputs([text] if text is not None else None, chat=True)
    with _tokenizer(request, chat, chat_template_file, offline) as tokenizer:
        ids = tokenizer.chat(message).tokens if chat else tokenizer.raw(message)
        vocab = tokenizer.vocabulary.vocab
        pieces = [show_piece(vocab.piece(token, special=True)) for token in ids]
        _notices(tokenizer, chat)
    if as_json:
        output.print_json({"ids": ids, "pieces": pieces})
        return
    width = len(str(max(ids, default=0)))
    for token, piece in zip(ids, pieces, strict=True):
        print(f"{token:>{width}}  {json.dumps(piece, ensure_ascii=False)}")


def show_piece(piece: bytes) -> str:
    """A token's bytes as text: UTF-8 where they are, `\\xNN` for bytes that are not (part of a character)."""
    return piece.decode("utf-8", "backslashreplace")


def _tokenizer(request: Request, chat: bool, template_file: Path | None, offline: bool) -> Tokenizer:
    """The model's vocabulary (and, with --chat, its template)."""
    from llmcli.pipeline.local import open_tokenizer

    return open_tokenizer(replace(request, raw=not chat, template_file=template_file, offline=offline))


def _check_chat_only(request: Request, chat: bool, template_file: Path | None) -> None:
    """Without --chat the text is counted as-is: what only shapes a chat prompt is refused rather than ignored."""
    chat_only = [flag for flag, value in (("--system", request.settings.get("system")),
                                          ("--think/--no-think", request.settings.get("think")),
                                          ("--chat-template-file", template_file)) if value is not None]
    if chat_only and not chat:
        raise UsageError(f"{', '.join(chat_only)} shape the chat prompt: add --chat",
                         hint="Without --chat the text is taken as-is (as `run --raw` sends it).")


def _notices(tokenizer: Tokenizer, chat: bool) -> None:
    """What the template lookup found worth saying (no template, a --think it ignores), when it was used."""
    from llmcli.cli import output

    if not chat:
        return
    console = output.stderr_console()
    for notice in tokenizer.notices:
        output.print_notice(console, notice)


def _inputs(arguments: list[str] | None, chat: bool) -> list[tuple[str, str]]:
    """(name, text) to count: files (or stdin); with `chat`, the prompt and piped stdin as `run` combines them."""
    from llmcli.cli.inputs import combine_input, read_message

    if chat:
        if arguments and len(arguments) > 1:
            raise UsageError("--chat counts one prompt: quote it as one argument")
        prompt, stdin_text, _ = read_message(arguments[0] if arguments else None)
        return [("prompt", combine_input(prompt, stdin_text))]
    if not arguments or arguments == ["-"]:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("nothing to count: name files, or pipe text in",
                             hint="llmcli count FILE… or cat FILE | llmcli count")
        _, stdin_text, _ = read_message(None)
        return [("-", stdin_text or "")]
    if len(arguments) == 1 and _is_text(arguments[0]):
        from llmcli.cli import output

        output.print_notice(output.stderr_console(), "no file of that name: counting the argument itself as text")
        return [("text", arguments[0])]
    return [(name, "" if name == "-" else read_text_file(Path(name))) for name in arguments]


def _is_text(argument: str) -> bool:
    """`count "Hello world"`: an argument that names no file and does not look like a path or a file's name
    (`notes.md`: a missing file is an error, exit 2) is the text to count."""
    if argument == "-" or os.path.lexists(argument):
        return False
    if any(c.isspace() for c in argument):
        return True
    return "/" not in argument and not _FILE_NAME.fullmatch(argument)


_FILE_NAME = re.compile(r"[\w.-]*\w\.[A-Za-z][A-Za-z0-9]{0,7}")  # a name with an extension: report.md, notes.txt


def read_text_file(path: Path) -> str:
    """A file's text as `run` would take it piped in (its final newline dropped); one-line errors otherwise."""
    from llmcli.cli.inputs import max_stdin_bytes

    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise UsageError(f"{path} is a directory, not a text file")
        with path.open("rb") as handle:
            data = handle.read(max_stdin_bytes() + 1)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > max_stdin_bytes():
        raise UsageError(f"{path} is larger than {max_stdin_bytes():,} bytes; no context window takes that much")
    nul = data.find(b"\0")
    if nul >= 0:
        raise UsageError(f"{path} is not a text file (a NUL byte at offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (an invalid byte at offset {exc.start})") from None
    return text.rstrip("\r\n")
