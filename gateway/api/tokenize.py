"""vLLM's tokenizer endpoints and the small lookups: `/tokenize`, `/detokenize`, `/version`,
`GET /v1/models` and `GET /v1/models/{id}`.

Shapes follow vLLM's OpenAI server, so routers written against vLLM's tokenizer endpoints work:

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                   or {model?, messages, add_generation_prompt=true, continue_final_message=false,
                       add_special_tokens=false, tools?, return_token_strs=false}
                      -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {model?, tokens} -> {prompt}
    GET  /version     -> {version}

`model` may be left out when the gateway serves one model (as vLLM, which serves one). The chat form
renders the model's chat template exactly as /v1/chat/completions does, so `count` is the prompt's
length there. No engine is involved: these answer from the gateway's own tokenizer.
"""

from __future__ import annotations

from importlib import metadata

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from duet.tokenizer import ChatTemplateError, TokenizerError
from gateway import errors
from gateway.api.protocol import chat_messages, chat_tools
from gateway.api.request_models import DetokenizeRequest, TokenizeChatRequest, TokenizePromptRequest
from gateway.api.validation import validate
from gateway.body_parser import parse_json_body
from gateway.models import ServedModel
from gateway.serving.context import ServingContext, serving_context
from gateway.serving.tools import render_chat


def _model(ctx: ServingContext, name: str | None) -> ServedModel:
    if name is None and len(ctx.models) == 1:
        return next(iter(ctx.models.values()))
    if not name:
        raise errors.InvalidRequest("model: is required when the gateway serves several models", "model")
    model = ctx.models.get(name)
    if model is None:
        raise errors.ModelNotFound(name)
    return model


def _chat_ids(model, req: TokenizeChatRequest) -> list[int]:
    tok = model.tokenizer
    messages = chat_messages(req.messages)  # the same message and tool rules as chat completions
    tools = chat_tools(req, messages)
    if req.continue_final_message:
        if messages[-1].get("role") != "assistant":
            raise errors.InvalidRequest("continue_final_message: needs the last message to be the assistant's",
                                        "continue_final_message")
        if req.add_generation_prompt:
            raise errors.InvalidRequest("add_generation_prompt: excludes 'continue_final_message'",
                                        "add_generation_prompt")
    add_generation_prompt = not req.continue_final_message and req.add_generation_prompt is not False
    rendered, template_tools = render_chat(messages, tools, tok.template_takes_tools)
    text = tok.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tools=template_tools)
    if req.continue_final_message:
        # the template closes every turn; cut after the final message's own text so the prompt ends
        # mid-turn and a generation continues it (what vLLM's flag does)
        final = messages[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        text = text[: cut + len(final)] if cut >= 0 else text
    return tok.encode(text, add_special_tokens=bool(req.add_special_tokens))


async def tokenize(request: Request) -> Response:
    ctx = serving_context(request)
    try:
        body = parse_json_body(await request.body())
        chat = isinstance(body, dict) and "messages" in body
        req = validate(TokenizeChatRequest if chat else TokenizePromptRequest, body)
        model = _model(ctx, req.model)
        if chat:
            ids = _chat_ids(model, req)
        else:
            ids = model.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    except ChatTemplateError as e:
        return errors.error_response(errors.InvalidRequest(f"messages rejected by the chat template: {e}",
                                                           "messages"))
    except TokenizerError as e:
        return errors.error_response(errors.InvalidRequest(f"the text cannot be tokenized: {e}", "prompt"))
    except errors.GatewayError as e:
        return errors.error_response(e)
    tok = model.tokenizer
    return JSONResponse({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                         "token_strs": [tok.id_to_token(t) for t in ids] if req.return_token_strs else None})


async def detokenize(request: Request) -> Response:
    ctx = serving_context(request)
    try:
        req = validate(DetokenizeRequest, parse_json_body(await request.body()))
        model = _model(ctx, req.model)
        vocab = model.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise errors.InvalidRequest(f"tokens: token id {max(req.tokens)} is out of the vocabulary ({vocab})",
                                        "tokens")
    except errors.GatewayError as e:
        return errors.error_response(e)
    return JSONResponse({"prompt": model.tokenizer.decode(req.tokens)})


def duet_version() -> str:
    try:
        return metadata.version("duet")
    except metadata.PackageNotFoundError:  # a source tree without an install
        return "0+unknown"


async def version(request: Request) -> Response:
    return JSONResponse({"version": duet_version()})


def model_card(m) -> dict:
    return {"id": m.model_id, "object": "model", "created": 0, "owned_by": "duet", "max_model_len": m.max_model_len}


async def list_models(request: Request) -> Response:
    """The served models a worker can answer now (healthy, not draining): a client that lists a model can use it;
    one still loading on every worker is listed once it is ready."""
    ctx = serving_context(request)
    answering = {v.model_id for v in ctx.router.views() if v.healthy and not v.draining}
    data = [model_card(m) for m in ctx.models.values() if m.model_id in answering]
    return JSONResponse({"object": "list", "data": data})


async def retrieve_model(request: Request) -> Response:
    ctx = serving_context(request)
    name = request.path_params["model_id"]
    model = ctx.models.get(name)
    if model is None:
        return errors.error_response(errors.ModelNotFound(name))
    return JSONResponse(model_card(model))
