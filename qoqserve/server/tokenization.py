"""vLLM's /tokenize and /detokenize: the served tokenizer, and the chat
template exactly as /v1/chat/completions renders a conversation (so a
client can count a prompt's tokens before sending it)."""
from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Field, Tag

from qoqserve.server.protocol import (
    APIError,
    ChatMessage,
    ChatTemplateFields,
    StrictRequest,
    Text,
    Tool,
    function_dicts,
)
from qoqserve.server.serving import OpenAIServing


class TokenizeCompletionRequest(StrictRequest):
    """vLLM's /tokenize of a text."""
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = Field(True, description="BOS where the model wants one")
    return_token_strs: bool = Field(False, description="also each token's text")


class TokenizeChatRequest(ChatTemplateFields):
    """vLLM's /tokenize of a conversation, through the chat template as /v1/chat/completions renders it."""
    model: Text | None = None
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    return_token_strs: bool = False


def _tokenize_kind(body) -> str:
    return "chat[messages]" if isinstance(body, dict) and "messages" in body else "text[prompt]"


# one body, two shapes, told apart by `messages` (the tags hold "[": error paths drop them)
TokenizeRequest = Annotated[Annotated[TokenizeChatRequest, Tag("chat[messages]")]
                            | Annotated[TokenizeCompletionRequest, Tag("text[prompt]")], Discriminator(_tokenize_kind)]


class DetokenizeRequest(StrictRequest):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    serving.check_model(req.model)
    tok = serving.tokenizer
    if isinstance(req, TokenizeChatRequest):
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        ids = serving.chat_prompt(req, req.messages, function_dicts(req.tools), req.add_special_tokens)
    else:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids,
            "token_strs": [tok.token_to_str(t) for t in ids] if req.return_token_strs else None}


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    serving.check_model(req.model)
    vocab = serving.engine.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens must be below the vocabulary size {vocab}", param="tokens")
    return {"prompt": serving.tokenizer.decode(req.tokens)}
