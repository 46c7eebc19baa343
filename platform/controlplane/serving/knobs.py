"""The sampling knobs of an OpenAI request, read and bounded at the edge (pure).

OpenAI's own: ``frequency_penalty`` and ``presence_penalty`` (numbers in [-2, 2]) and
``logit_bias`` (an object from token ids, as strings, to numbers in [-100, 100], at most
``MAX_LOGIT_BIAS`` of them, each id the model's). Those vLLM and llama.cpp's server take, and chat
front ends expose as sliders: ``top_k`` (an integer up to ``MAX_TOP_K``; 0 or -1 for none), ``min_p`` (in [0, 1]) and
``repetition_penalty`` (a number above 0). Each value outside its bounds is a 400 naming it; null
is the value that asks for nothing. Main applies them (``inference.runtime.engine.sampling``) and
refuses again what a broken or hostile control plane might send past these checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from inference.wire.generation import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, MAX_TOP_K, PENALTY_LIMIT

from .text import InputError

# The largest integer a knob may be sent as: past it, a float cannot hold it (and JSON's bignums
# would overflow math.isfinite). Every knob's own bound is far below.
MAX_INTEGER = 2**53


def _number(value: object) -> bool:
    """A finite JSON number (not a bool, not an integer past ``MAX_INTEGER``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= MAX_INTEGER
    return isinstance(value, float) and math.isfinite(value)


def check_knobs(body: Mapping[str, object], vocab: int) -> dict[str, object]:
    """The knobs ``body`` sets, as ``Generate``'s fields (``Sampling.knobs``), for a model of ``vocab``
    tokens; what it leaves out or sends as null is left at its neutral value."""
    knobs: dict[str, object] = {}
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not -1 <= top_k <= MAX_TOP_K:
            raise InputError(f"top_k must be an integer from 1 to {MAX_TOP_K} (0 or -1: no top-k)", param="top_k")
        knobs["top_k"] = max(top_k, 0)
    min_p = body.get("min_p")
    if min_p is not None:
        if not _number(min_p) or not 0 <= min_p <= 1:
            raise InputError("min_p must be a number in [0, 1]", param="min_p")
        knobs["min_p"] = float(min_p)
    penalty = body.get("repetition_penalty")
    if penalty is not None:
        if not _number(penalty) or not penalty > 0:
            raise InputError("repetition_penalty must be a number above 0 (1: none)", param="repetition_penalty")
        knobs["repetition_penalty"] = float(penalty)
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is None:
            continue
        if not _number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise InputError(f"{name} must be a number from -{PENALTY_LIMIT:g} to {PENALTY_LIMIT:g}", param=name)
        knobs[name] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        pairs = _logit_bias(bias, vocab)
        if pairs:
            knobs["logit_bias"] = pairs
    return knobs


def _logit_bias(bias: object, vocab: int) -> list[tuple[int, float]]:
    """``logit_bias`` as (token id, bias) pairs in id order."""
    if not isinstance(bias, dict):
        message = 'logit_bias must be an object from token ids to biases, e.g. {"50256": -100}'
        raise InputError(message, param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InputError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias")
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) < 12 else -1
        if not 0 <= token < vocab:
            message = f"logit_bias: {key!r:.30} is not a token id of this model (0 to {vocab - 1})"
            raise InputError(message, param="logit_bias")
        if token in pairs:
            raise InputError(f"logit_bias names token {token} more than once", param="logit_bias")
        if not _number(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InputError(
                f"logit_bias[{token}] must be a number from -{LOGIT_BIAS_LIMIT:g} to {LOGIT_BIAS_LIMIT:g}",
                param="logit_bias",
            )
        pairs[token] = float(value)
    return sorted(pairs.items())
