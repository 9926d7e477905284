"""vLLM's tokenizer endpoints and the small lookups: `/tokenize`, `/detokenize`, `/version`,
`GET /v1/models/{id}`.

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
from gateway.body_parser import parse_json_body
from gateway.protocol import MAX_TOKEN_ID, parse_chat
from gateway.tools import render_chat


def _model(gw, body: dict):
    name = body.get("model")
    if name is None and len(gw.models) == 1:
        return next(iter(gw.models.values()))
    if not isinstance(name, str) or not name:
        raise errors.InvalidRequest("'model' is required (a string) when the gateway serves several models", "model")
    model = gw.models.get(name)
    if model is None:
        raise errors.ModelNotFound(name)
    return model


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise errors.InvalidRequest(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _body(raw: bytes) -> dict:
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    return body


def _chat_ids(model, body: dict) -> list[int]:
    tok = model.tokenizer
    api = parse_chat({**body, "model": model.model_id})  # the same message and tool rules as chat completions
    if _flag(body, "continue_final_message", False):
        if api.messages[-1].get("role") != "assistant":
            raise errors.InvalidRequest("'continue_final_message' needs the last message to be the assistant's",
                                        "continue_final_message")
        if _flag(body, "add_generation_prompt", False):
            raise errors.InvalidRequest("'continue_final_message' and 'add_generation_prompt' exclude each other",
                                        "add_generation_prompt")
        add_generation_prompt = False
    else:
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
    messages, tools = render_chat(list(api.messages), api.tools, tok.template_takes_tools)
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    if _flag(body, "continue_final_message", False):
        # the template closes every turn; cut after the final message's own text so the prompt ends
        # mid-turn and a generation continues it (what vLLM's flag does)
        final = api.messages[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        text = text[: cut + len(final)] if cut >= 0 else text
    return tok.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))


async def tokenize(request: Request) -> Response:
    gw = request.app.state.gateway
    try:
        body = _body(await request.body())
        model = _model(gw, body)
        strs = _flag(body, "return_token_strs", False)
        if "messages" in body:
            ids = _chat_ids(model, body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise errors.InvalidRequest("give 'prompt' (a string) or 'messages' (a chat)", "prompt")
            ids = model.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    except ChatTemplateError as e:
        return errors.error_response(errors.InvalidRequest(f"messages rejected by the chat template: {e}",
                                                           "messages"))
    except TokenizerError as e:
        return errors.error_response(errors.InvalidRequest(f"the text cannot be tokenized: {e}", "prompt"))
    except errors.GatewayError as e:
        return errors.error_response(e)
    tok = model.tokenizer
    return JSONResponse({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                         "token_strs": [tok.id_to_token(t) for t in ids] if strs else None})


async def detokenize(request: Request) -> Response:
    gw = request.app.state.gateway
    try:
        body = _body(await request.body())
        model = _model(gw, body)
        ids = body.get("tokens")
        vocab = model.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < min(vocab, MAX_TOKEN_ID) for t in ids):
            raise errors.InvalidRequest(f"'tokens' must be a list of token ids (0 <= id < {vocab})", "tokens")
    except errors.GatewayError as e:
        return errors.error_response(e)
    return JSONResponse({"prompt": model.tokenizer.decode(ids)})


def duet_version() -> str:
    try:
        return metadata.version("duet")
    except metadata.PackageNotFoundError:  # a source tree without an install
        return "0+unknown"


async def version(request: Request) -> Response:
    return JSONResponse({"version": duet_version()})


def model_card(m) -> dict:
    return {"id": m.model_id, "object": "model", "created": 0, "owned_by": "duet", "max_model_len": m.max_model_len}


async def retrieve_model(request: Request) -> Response:
    gw = request.app.state.gateway
    name = request.path_params["model_id"]
    model = gw.models.get(name)
    if model is None:
        return errors.error_response(errors.ModelNotFound(name))
    return JSONResponse(model_card(model))
