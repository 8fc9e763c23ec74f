"""Structured outputs on xgrammar: a request's StructuredOutputs compiled to
a grammar (once per distinct spec: an LRU cache), and a matcher per request
that the sampler asks for the tokens allowed next (layers/token_mask.py).

Compiling happens at admission, on the caller's thread (the server runs it
in a worker thread), never on the engine thread, so a slow schema stalls no
step. The matcher only accepts a token once a step has succeeded and the
token is the sequence's (LLMEngine.step): a failed step that is re-run
(engine/isolation.py) finds the matcher as it was, and a preempted sequence
keeps its matcher, since recomputing its tokens changes none of them.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from qoqserve.errors import InvalidRequestError
from qoqserve.model_loader.tokenizer import Tokenizer
from qoqserve.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's errors start with "[time] /path/file.cc:line: "
_LOCATION = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def _ebnf_string(s: str) -> str:
    """s as a GBNF string literal (the escapes JSON uses)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace(
        "\r", "\\r").replace("\t", "\\t") + '"'


def choice_grammar(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(_ebnf_string(c) for c in choices)


class GrammarConstraint:
    """One request's matcher: what the sampler's TokenConstraint asks of it."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        import xgrammar as xgr  # lazy: see GrammarCompiler._xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token}, which its mask allowed")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe. The tokenizer
    view xgrammar needs (a walk over the whole vocabulary) is built on first use,
    so an engine that never sees a structured request never pays it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = 256, threads: int = 2, max_whitespace: int = 0):
        if not isinstance(max_whitespace, int) or isinstance(max_whitespace, bool) or max_whitespace < 0:
            raise ValueError(f"structured_outputs_max_whitespace must be an integer >= 0, got {max_whitespace!r}")
        self.max_whitespace = max_whitespace  # per gap of constrained JSON; 0: unbounded
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size, self.threads = cache_size, threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _xgr(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # lazy: xgrammar and transformers (only needed to hand xgrammar the
                # vocabulary) are slow to import: the first constrained request pays it
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            return self._compiler

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The spec's grammar; raises InvalidRequestError naming what is wrong
        (code invalid_grammar, or unsupported_schema for a schema feature
        xgrammar does not implement)."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self._compile(spec, self._xgr(), self.max_whitespace or None)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(spec: StructuredOutputs, c: xgr.GrammarCompiler, max_ws: int | None) -> xgr.CompiledGrammar:
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if kind == "json" else {"type": "object"}  # OpenAI's json_object: an object
                return c.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                             max_whitespace_cnt=max_ws)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                return c.compile_grammar(spec.grammar)
            return c.compile_structural_tag(spec.structural_tag)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            msg = _LOCATION.sub("", str(e)).strip() or type(e).__name__
            unsupported = "nsupported" in msg or "not supported" in msg
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                    "choice": "choice list", "structural_tag": "structural tag"}.get(kind, kind)
            raise InvalidRequestError(
                f"the {what} is {'not supported' if unsupported else 'invalid'}: {msg}",
                param=f"structured_outputs.{kind}",
                code="unsupported_schema" if unsupported else "invalid_grammar") from None
