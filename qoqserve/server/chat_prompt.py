"""A chat request's conversation as prompt token ids: its messages (tools
folded in as the template expects them: server/tools.py) through the model's
chat template, or the request's own where the server trusts those, with
vLLM's render options (model_loader/chat_template.py); every way it can fail
a 400 naming the field."""
from __future__ import annotations

from qoqserve.model_loader.chat_template import ChatTemplateError
from qoqserve.model_loader.tokenizer import Tokenizer
from qoqserve.server.protocol import APIError, ChatTemplateFields
from qoqserve.server.tools import template_messages, template_speaks_tools


def _message(m) -> dict:
    d = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        d["tool_calls"] = m.tool_calls
    for key in ("tool_call_id", "name"):
        v = getattr(m, key, None) or (m.model_extra or {}).get(key)
        if isinstance(v, str):
            d[key] = v
    return d


def chat_prompt_ids(tokenizer: Tokenizer, req: ChatTemplateFields, messages: list, tools: list[dict],
                    trust_request_template: bool, add_special_tokens: bool = False) -> list[int]:
    """The token ids of the rendered conversation (the template already
    carries BOS where the model wants one)."""
    template = tokenizer.chat_template
    if req.chat_template is not None:
        if not trust_request_template:
            raise APIError(400, "this server does not take chat templates from requests (start it with "
                                "--trust-request-chat-template)", param="chat_template")
        template = req.chat_template
    if template is None:
        raise APIError(400, "this model has no chat template (start the server with --chat-template, or "
                            "send a plain prompt to /v1/completions)", param="messages")
    native = template_speaks_tools(template)
    turns = template_messages([_message(m) for m in messages], tools, native)
    extra = {"tools": [{"type": "function", "function": f} for f in tools]} if tools and native else {}
    try:
        text = tokenizer.apply_chat_template(
            turns, req.add_generation_prompt, continue_final_message=req.continue_final_message,
            chat_template=template, template_kwargs=req.chat_template_kwargs, **extra)
    except ChatTemplateError as e:  # the request's options or template
        raise APIError(400, str(e), param=e.option) from None
    except Exception as e:  # templates raise on e.g. roles out of order
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
