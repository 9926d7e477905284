"""The models a gateway serves: each one's tokenizer, chat template and context length.

The gateway owns tokenization (token ids cross the gRPC boundary, not text), so it needs every
model's directory; only the tokenizer files and config.json are read (no weights, no torch), so a folder
without the weights serves as well. The
API name of a model is its `model_id` (the directory name), the same id workers report in GetInfo.
"""

from __future__ import annotations

from dataclasses import dataclass

from duet.model_dir import read_model_dir
from duet.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServedModel:
    model_id: str
    tokenizer: Tokenizer
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def load_models(paths: tuple[str, ...]) -> dict[str, ServedModel]:
    """model_id -> ServedModel; raises ModelDirError / TokenizerError with the bad path."""
    models: dict[str, ServedModel] = {}
    for path in paths:
        md = read_model_dir(path, weights=False)
        tok = Tokenizer.from_dir(md.path)
        eos = tuple(dict.fromkeys(md.config.eos_token_ids + tok.eos_token_ids))
        models[md.model_id] = ServedModel(md.model_id, tok, md.config.max_position_embeddings, eos)
    return models
