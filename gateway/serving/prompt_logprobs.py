"""The prompt's own logprobs, as the engines return them (one `pb.TokenLogprob` per prompt token from the
second on), in the two shapes clients read:

- OpenAI's legacy completions shape (`echo` with `logprobs`): the echoed prompt's tokens lead the
  choice's `logprobs`, the first with a null logprob and null alternatives (it has no context), and
  `text_offset` counts characters of the echoed text. lm-evaluation-harness scores with this.
- vLLM's `prompt_logprobs`: a list with one entry per prompt token, the first null, each a map
  `{token id: {logprob, rank, decoded_token}}` of the prompt token and its top alternatives
  (rank is left null: the engines do not rank the whole vocabulary).
"""

from __future__ import annotations

from duet.detokenizer import IncrementalDetokenizer


def text_offsets(tokenizer, ids: list[int]) -> tuple[list[int], int]:
    """Where each token's text starts in the decoded text of `ids`, and that text's length."""
    detok = IncrementalDetokenizer(tokenizer)
    offsets, length = [], 0
    for t in ids:
        offsets.append(length)
        length += len(detok.push([t]))
    length += len(detok.flush())
    return offsets, length


def legacy(tokenizer, prompt_ids: list[int], lps, top_n: int) -> dict:
    """The `logprobs` fields (tokens, token_logprobs, top_logprobs, text_offset) of the echoed prompt."""
    token = _token_text(tokenizer)
    offsets, _ = text_offsets(tokenizer, prompt_ids)
    tokens = [token(t) for t in prompt_ids]
    missing = len(prompt_ids) - len(lps)  # 1 (the first token); more only from a worker that returned none
    values: list[float | None] = [None] * missing
    tops: list[dict | None] = [None] * missing
    for lp in lps:
        values.append(lp.logprob)
        tops.append(top_map((token(a.token_id), a.logprob) for a in lp.top[:top_n]))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def top_map(top) -> dict[str, float]:
    """OpenAI's `{token text: logprob}` of the alternatives `(text, logprob)`, best first; two ids with one
    text keep the better."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


def vllm(tokenizer, prompt_ids: list[int], lps) -> list[dict | None]:
    token = _token_text(tokenizer)
    out: list[dict | None] = [None] * (len(prompt_ids) - len(lps))
    for lp in lps:
        entry = {str(a.token_id): {"logprob": a.logprob, "rank": None, "decoded_token": token(a.token_id)}
                 for a in lp.top}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": None, "decoded_token": token(lp.token_id)}
        out.append(entry)
    return out


def _token_text(tokenizer):
    return lambda t: tokenizer.decode([t], skip_special_tokens=False)
