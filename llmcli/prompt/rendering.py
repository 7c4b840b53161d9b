"""Step 2 for a local model: messages -> the exact text and tokens it sees — the chat template found and rendered
(with --think and the tools), the text tokenized, and each picture's tokens where its marker is."""

from __future__ import annotations

from collections.abc import Callable

from llmcli.answer.answerer import PromptOptions, RenderedPrompt
from llmcli.answer.images import MARKER as IMAGE_MARKER
from llmcli.answer.images import MAX_IMAGES, ImageInput
from llmcli.answer.message import Message
from llmcli.answer.reasoning import THINKING_SWITCHES, no_switch_notice, reads_thinking_switch
from llmcli.answer.tool_calls import ToolSpec
from llmcli.errors import TemplateError, UsageError
from llmcli.llama.vision import Vision
from llmcli.llama.vocab import Vocabulary
from llmcli.prompt import chat_template as templates
from llmcli.prompt import read_template_file
from llmcli.prompt.chat_template import ChatTemplate
from llmcli.store.gguf_header import GGUFHeader


def find_template(header: GGUFHeader, options: PromptOptions) -> tuple[ChatTemplate | None, list[str]]:
    """The chat template to use (--chat-template-file, else the model's; None: --raw or none stored), and
    notices for the user (no template; a --think the template does not read)."""
    if options.raw:
        return None, []
    path = options.template_file
    if path is not None:
        template = ChatTemplate(read_template_file(path), str(path))
    else:
        stored = header.chat_template
        if stored is None:
            return None, ["this model has no chat template; sending the prompt as-is (--raw)"]
        template = ChatTemplate(stored, "model")
    templates.check(template)
    notice = no_switch_notice(reads_thinking_switch(template.source), options.think)
    return template, [notice] if notice else []


def render_prompt(template: ChatTemplate | None, vocab: Vocabulary, messages: list[Message],
                  options: PromptOptions, tools: ToolSpec | None = None,
                  vision: Callable[[], Vision] | None = None) -> RenderedPrompt:
    """Messages -> the exact text and tokens the model sees: the chat template (with --think/--no-think and the
    tools), or without one the contents joined by blank lines; each image's tokens where its marker is."""
    messages, variables = templates.tools_in_prompt(messages, tools, template.source if template else None)
    images = [image for message in messages for image in message.images]
    if template is None:
        text = "\n\n".join(m.content for m in messages)
        return _tokenized(text, vocab, True, images, vision)
    bos = vocab.bos_text
    text = template.render(messages, bos_token=bos, eos_token=vocab.eos_text,
                           variables={**thinking_variables(options.think), **variables})
    # A template that writes the BOS token itself must not get a second one from the tokenizer.
    return _tokenized(text, vocab, not (bos and text.startswith(bos)), images, vision)


def _tokenized(text: str, vocab: Vocabulary, add_special: bool, images: list[ImageInput],
               load_vision: Callable[[], Vision] | None) -> RenderedPrompt:
    if not images:
        return RenderedPrompt(text, vocab.tokenize(text, add_special=add_special))
    if load_vision is None:
        raise UsageError("images are not read here: only a model loaded with its projector sees them")
    vision = load_vision()
    if len(images) > MAX_IMAGES:
        raise UsageError(f"{len(images)} images: a prompt takes at most {MAX_IMAGES}")
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) != len(images) + 1:
        raise TemplateError(f"the chat template placed {len(pieces) - 1} of the prompt's {len(images)} images")
    tokens: list[int] = []
    for index, piece in enumerate(pieces):
        tokens += vocab.tokenize(piece, add_special=add_special and index == 0)
        if index < len(images):
            tokens += vision.tokenize(images[index])
    if tokens[-1] < 0:  # the answer's first token needs the logits of a text token
        tokens += vocab.tokenize("\n", add_special=False)
    return RenderedPrompt(text, tokens)


def thinking_variables(think: bool | None) -> dict[str, bool]:
    """--think / --no-think as the templates of reasoning models read it: Qwen3's `enable_thinking`, Granite's
    `thinking`; nothing when not given (the template's own default)."""
    return {} if think is None else dict.fromkeys(THINKING_SWITCHES, think)
