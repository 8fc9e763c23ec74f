"""vLLM's /tokenize and /detokenize: the served tokenizer, and the chat
template exactly as /v1/chat/completions renders a conversation (so a
client can count a prompt's tokens before sending it)."""
from __future__ import annotations

from qoqserve.server.protocol import (
    APIError,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    function_dicts,
)
from qoqserve.server.serving import OpenAIServing


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
