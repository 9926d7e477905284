"""The traffic class of a request, the `class` label of the gateway's latency histograms.

A chat turn and a document summary do not share one TTFT bound, so the SLO alerts
(deploy/prometheus/duet-rules.yml) group by model and class and give each class its own threshold.
Four values, so the label's cardinality stays bounded; docs/operations.md lists them.
"""

from __future__ import annotations

CLASSES = ("structured", "session", "document", "oneshot")
DOCUMENT_PROMPT_TOKENS = 1024  # a one-shot prompt this long is a document: its prefill dominates TTFT


def request_class(api, session_key: str | None, prompt_tokens: int,
                  document_tokens: int = DOCUMENT_PROMPT_TOKENS) -> str:
    """`api` a gateway.serving.api_request.ApiRequest; `session_key` the affinity key routing saw (x-session-id, a
    Responses conversation / previous_response_id). Structured output wins over the rest: its grammar
    shapes the latency whatever the prompt; then a conversation (a session key or more than one user
    turn, whose prefix is usually cached); then a long one-shot prompt; else a plain one-shot."""
    if "structured_output" in api.required_capabilities:
        return "structured"
    if session_key or (api.kind == "chat" and api.turn_count > 1):
        return "session"
    if prompt_tokens >= document_tokens:
        return "document"
    return "oneshot"
