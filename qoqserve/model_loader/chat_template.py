"""Chat templates: the model's own Jinja template or one given in its place
(`--chat-template`, a request's `chat_template`), compiled and rendered as
transformers renders them, with vLLM's options around the render.

A template is given as a file or as the template text itself, told apart as
vLLM tells them: text holding `{`, `}` or a newline is a template, anything
else names a file, and a file that cannot be read is an error that names it
(never a one-line "template" that renders the path as the prompt).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# what the renderer itself passes; a request's chat_template_kwargs may not replace them
RESERVED_NAMES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "bos_token",
                            "eos_token", "tools", "chat_template"})


class ChatTemplateError(ValueError):
    """A template that cannot be read or compiled, or a render option it cannot
    honour; `option` names the request field (vLLM's names) it comes from."""

    def __init__(self, message: str, option: str = "chat_template"):
        super().__init__(message)
        self.option = option


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}` marker (used for training masks) as a no-op."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF overrides jinja's tojson: no HTML escaping and non-ASCII kept as is
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)  # requests that bring a template mostly bring the same few
def compile_template(source: str, origin: str = "chat template") -> jinja2.Template:
    """The template compiled in transformers' environment (sandboxed, the same
    flags, filters and globals, so it renders the same text); a syntax error
    is a ChatTemplateError naming `origin` and the line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: Jinja syntax error at line {e.lineno}: {e.message}") from None


def load_chat_template(value: str) -> str:
    """The template text of `--chat-template VALUE` (a file, or the template
    itself), checked to compile."""
    if any(c in value for c in "{}\n"):
        compile_template(value, "the chat template given")
        return value
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ChatTemplateError(f"chat template {value!r} names a file (it holds no '{{', '}}' or newline) "
                                f"that could not be read: {reason}") from None
    compile_template(text, f"chat template file {value}")
    return text


def _content_text(content: Any) -> str:
    """A message's text: its string, or the text of its last part."""
    if isinstance(content, (list, tuple)):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        return texts[-1] if texts else ""
    return "" if content is None else str(content)


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, bos_token: str = "", eos_token: str = "",
                template_kwargs: dict | None = None, **extra: Any) -> str:
    """The conversation as the template writes it. continue_final_message
    (vLLM's, transformers' option): the last message left open, so that the
    model continues it: the render ends where that message's text ends (what
    the template writes after it, an end-of-turn, is cut)."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true",
                                "continue_final_message")
    clash = RESERVED_NAMES & set(template_kwargs or ())
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}: the "
                                "request's own fields do", "chat_template_kwargs")
    text = compile_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
        eos_token=eos_token, **{**(template_kwargs or {}), **extra})
    if not continue_final_message:
        return text
    final = _content_text(messages[-1].get("content")) if messages else ""
    # templates that trim the content write it stripped
    for piece in (final, final.strip()):
        at = text.rfind(piece) if piece else -1
        if at >= 0:
            return text[:at + len(piece)]
    raise ChatTemplateError("continue_final_message: the last message's text does not appear in the rendered "
                            "conversation (an empty message, or a template that rewrites it)",
                            "continue_final_message")
