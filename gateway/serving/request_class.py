"""The traffic class of a request, the `class` label of the gateway's latency histograms.

The classes, the rule and each class's SLO live in the one table, duet/traffic_classes.py; this module reads a
parsed request for that rule. A chat turn and a document summary do not share one TTFT bound, so the SLO alerts
(deploy/prometheus/duet-rules.yml, generated from the table) group by model and class and give each class its
own threshold. Four values, so the label's cardinality stays bounded; docs/operations.md lists them.
"""

from __future__ import annotations

from duet.contract import Capability
from duet.traffic_classes import CLASSES, DOCUMENT_PROMPT_TOKENS, classify

__all__ = ["CLASSES", "DOCUMENT_PROMPT_TOKENS", "request_class"]


def request_class(api, session_key: str | None, prompt_tokens: int,
                  document_tokens: int = DOCUMENT_PROMPT_TOKENS) -> str:
    """`api` a gateway.serving.api_request.ApiRequest; `session_key` the affinity key routing saw (x-session-id, a
    Responses conversation / previous_response_id). A conversation is a session key or more than one user
    turn; structured output is a request that needs the structured_output capability."""
    return classify(structured=Capability.STRUCTURED_OUTPUT in api.required_capabilities,
                    conversation=bool(session_key) or (api.kind == "chat" and api.turn_count > 1),
                    prompt_tokens=prompt_tokens, document_tokens=document_tokens)
