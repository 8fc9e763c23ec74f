"""The request fields that constrain the output -> one StructuredOutputs:
OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` and, for clients older than vLLM 0.12, its `guided_*`
fields. At most one of them may be set (tools make a fourth source: see
serving.py). Returns the spec with the field it came from, so errors found
later (compiling the grammar) name the field the client sent.
"""
from __future__ import annotations

from qoqserve.sampling_params import InvalidSamplingParams, StructuredOutputs
from qoqserve.server.protocol import APIError, SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KINDS = ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")


def requested_structure(req: SamplingFields) -> tuple[StructuredOutputs | None, str | None]:
    """(the spec, the request field it came from), or (None, None)."""
    sources: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, 'response_format of type "json_schema" needs json_schema.schema',
                           param="response_format.json_schema")
        sources.append(("response_format", {"json": rf.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        kinds = {k.rstrip("_"): getattr(so, k) for k in _KINDS if getattr(so, k) not in (None, False)}
        sources.append(("structured_outputs", {**kinds, "disable_any_whitespace": so.disable_any_whitespace}))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            sources.append((name, {kind: getattr(req, name)}))
    if not sources:
        return None, None
    if len(sources) > 1:
        raise APIError(400, f"{sources[0][0]} and {sources[1][0]} cannot be combined: send one "
                            "constraint on the output", param=sources[1][0])
    param, kwargs = sources[0]
    return spec_or_400(kwargs, param), param


def spec_or_400(kwargs: dict, param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except InvalidSamplingParams as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
