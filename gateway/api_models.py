"""The request bodies of the public API as pydantic models: the one description /openapi.json is
generated from (gateway/openapi.py), for client generators, the schemathesis tier and the test that
walks every documented field (tests/gateway/test_api_fields.py).

The parsers (gateway/protocol.py and the per-API *_input.py modules) stay the validators: they run
behind the body parser's depth and number bounds, and each names the bad field in its API's own
error shape. These models say the same ranges; the field walk fails when a documented field is
neither wired to behaviour nor refused, and the fuzz tier when the two disagree on what is valid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.extra_params import PRIORITY_RANGE
from gateway.protocol import MAX_BATCH_PROMPTS, MAX_N, MAX_STOP_STRINGS, MAX_TOKEN_ID

INT31 = 1 << 31
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID - 1)]
Text = Annotated[str, Field(min_length=1)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI-compatible servers do


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant", "developer", "system", "tool", "user"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only made tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    name: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class ResponseFormatPlain(BaseModel):
    type: Literal["text", "json_object"]


class ResponseFormatSchema(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class _Sampling(_Body):
    """The sampling fields both OpenAI endpoints take (vLLM's extras included)."""

    max_tokens: Annotated[int, Field(ge=1, le=INT31)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=1e-9, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.001, le=10)] | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT31)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormatPlain | ResponseFormatSchema | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Bias],
                          Field(max_length=1024)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's extras (gateway/extra_params.py)
    use_beam_search: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=64)] | None = None
    length_penalty: float | None = None
    regex: Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=256)] | None = None
    speculative: bool | None = None
    priority: Annotated[int, Field(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] | None = None
    # the client's own deadline in seconds (the SDKs send it as a header; gateway/timeouts.py)
    timeout: Annotated[float, Field(gt=0)] | None = None


class ChatCompletionRequest(_Sampling):
    model: Text
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT31)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(_Sampling):
    model: Text
    prompt: (Text | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Text], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_BATCH_PROMPTS)])
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


# -- the Responses API ------------------------------------------------------------------------
class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponsesTool(BaseModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormatPlain(BaseModel):
    type: Literal["text", "json_object"]


class TextFormatSchema(BaseModel):
    type: Literal["json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None


class TextOptions(BaseModel):
    format: TextFormatPlain | TextFormatSchema | None = None


class ResponsesRequest(_Body):
    model: Text
    input: Text | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedChoice | None = None
    text: TextOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT31)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=1e-9, le=1)] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    parallel_tool_calls: Literal[True] | None = None
    truncation: Literal["disabled"] | None = None


# -- the Anthropic Messages API --------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock]


class AnthropicTool(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesMetadata(BaseModel):
    user_id: str | None = None


class _MessagesBase(_Body):
    model: Text
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class MessagesRequest(_MessagesBase):
    max_tokens: Annotated[int, Field(ge=1, le=INT31)]
    stop_sequences: Annotated[list[Text], Field(max_length=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=1e-9, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    stream: bool | None = None
    metadata: MessagesMetadata | None = None


class CountTokensRequest(_MessagesBase):
    pass


# -- vLLM's tokenizer endpoints --------------------------------------------------------------
class TokenizePromptRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m for m in (ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                            CountTokensRequest, TokenizePromptRequest, TokenizeChatRequest, DetokenizeRequest)}
