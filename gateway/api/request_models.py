"""The OpenAI (and vLLM) request bodies as pydantic models: the one description of every field,
type and range. They validate (gateway/api/validation.py turns their errors into 400s naming the
field) and /openapi.json is generated from them (gateway/openapi.py). What one field cannot say
alone (top_logprobs needs logprobs, a tool_choice naming a listed tool, which engine kind can serve
the combination) is gateway/api/protocol.py's, which makes the validated model an `ApiRequest`.

The Responses and Anthropic Messages bodies are in gateway/api/responses_input.py and
gateway/api/messages_input.py, the response shapes in gateway/api/answer_models.py. Every model is strict
(a string is not a number, 1 is not true) except that an integral float is an integer, as JSON
Schema says (2.0 is 2); unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from gateway.api.validation import PATTERN_PHRASES

MAX_TOKEN_ID = 1 << 31  # token ids travel as uint32; no vocabulary comes near this
MAX_STOP_STRINGS = 16
MAX_N = 64
MAX_BEAM_WIDTH = 64
MAX_CHOICES = 256
MAX_TOOLS = 128
MAX_BATCH_PROMPTS = 256
MAX_LOGIT_BIAS_TOKENS = 1024
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # GenerateRequest.priority is an int32
INT31 = 1 << 31
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
TOKEN_KEY = r"^[0-9]{1,9}$"
PATTERN_PHRASES[FUNCTION_NAME] = "must be 1-64 letters, digits, '_', '.' or '-'"
PATTERN_PHRASES[TOKEN_KEY] = 'keys must be token ids (digits, e.g. "42")'


def _integral(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(lo: int, hi: int):
    """An integer in [lo, hi]; an integral float (2.0) is one too."""
    return Annotated[int, Field(ge=lo, le=hi), BeforeValidator(_integral)]


TokenId = Int(0, MAX_TOKEN_ID - 1)
Text = Annotated[str, Field(min_length=1)]
Name = Annotated[str, Field(pattern=FUNCTION_NAME)]
Schema = dict[str, Any]  # a JSON schema, passed to the engine's grammar compiler as it is
MaxTokens = Int(1, INT31)
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(ge=1e-9, le=1)]
TopK = Int(0, 1 << 20)  # 0: no top-k
StopList = Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)]
ToolChoiceMode = Literal["none", "auto", "required"]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON string, as the model wrote it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only made tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers


class FunctionDef(Strict):
    name: Name
    description: str | None = None
    parameters: Schema | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(Strict):
    name: str | None = None
    schema_: Annotated[Schema, Field(alias="schema")]


class ResponseFormatPlain(Strict):
    type: Literal["text", "json_object"]


class ResponseFormatSchema(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(Strict):
    include_usage: bool | None = None


class _Sampling(Strict):
    """The fields both OpenAI endpoints take (vLLM's extras included, gateway/api/extra_params.py)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=0.001, le=10)] | None = None
    seed: Int(-(1 << 63), (1 << 64) - 1) | None = None
    n: Int(1, MAX_N) | None = None
    stop: Text | StopList | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Int(0, INT31) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: Annotated[ResponseFormatPlain | ResponseFormatSchema, Field(discriminator="type")] | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=TOKEN_KEY)], Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    prompt_logprobs: Int(0, 20) | None = None
    use_beam_search: bool | None = None
    best_of: Int(1, MAX_BEAM_WIDTH) | None = None
    length_penalty: float | None = None
    regex: Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    speculative: bool | None = None
    priority: Int(*PRIORITY_RANGE) | None = None
    # the client's own deadline in seconds (the SDKs send it as a header; gateway/serving/timeouts.py)
    timeout: Annotated[float, Field(gt=0)] | None = None


class ChatCompletionRequest(_Sampling):
    model: Text
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Int(0, 20) | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None


class CompletionRequest(_Sampling):
    model: Text
    prompt: (str | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_BATCH_PROMPTS)])
    max_tokens: Int(0, INT31) | None = None  # 0 with echo: score the prompt only
    echo: bool | None = None
    logprobs: Int(0, 20) | None = None


# -- vLLM's tokenizer endpoints --------------------------------------------------------------
class TokenizePromptRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
