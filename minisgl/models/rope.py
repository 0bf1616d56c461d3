"""Rotary position embeddings: the settings a checkpoint gives, the rotation speed of each
dimension pair, and the check that those speeds can still tell positions apart.

Rotary rotates dimension pair i of q and k by the angle position * inv_freq[i]. Angles are
computed in float32 (decoder.Rotation), and the cos/sin are then rounded to the model's dtype.
A config can be valid JSON, positive and finite, and still make these numbers meaningless: a
rope_theta of 1e-45 gives infinite speeds (nan angles, every token 0), a linear factor of 1e40
gives speeds so slow that every position gets the same rotation. `check_rope` bounds them from
that arithmetic.
"""

from __future__ import annotations

import math
from numbers import Real
from pathlib import Path

import torch
from transformers import PretrainedConfig

# Positions and angles are float32: above 2**24 consecutive integers (positions) round to the same
# float, and an angle above 2**24 radians is only known to within a radian (a whole rotation is lost).
FLOAT32_EXACT = 2 ** 24

# The fields each rope_type reads besides rope_theta, named by an error about its scaled speeds.
SCALING_FIELDS = {"default": (), "linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_parameters(config: PretrainedConfig) -> dict:
    """Rotary settings as one dict with at least rope_type and rope_theta.

    transformers 5.x gives `config.rope_parameters`; 4.x gives `rope_theta` plus an
    optional `rope_scaling` dict (whose type key was once called "type").
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Rotation speed of each of the head_dim/2 dimension pairs, float32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":  # positions divided by `factor`, i.e. every speed slowed equally
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        # Slow pairs (wavelength longer than the original context / low_freq_factor) are
        # slowed further by `factor`; fast pairs (shorter than context / high_freq_factor)
        # are kept; pairs in between are blended linearly between the two.
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        keep = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return keep * inv_freq + (1 - keep) * inv_freq / factor
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SCALING_FIELDS)}")


def check_rope(params: dict, head_dim: int, window: int, dtype: torch.dtype, path: Path) -> None:
    """One ValueError naming the field, unless rotary can tell every position of the model's
    window apart in `dtype`:

    - every field is a positive finite number (llama3 also needs low_freq_factor != high_freq_factor);
    - the window's positions are exact in float32 (window <= 2**24);
    - rope_theta's speeds are finite, above 0 and all different in float32 (theta 1, or 1e-45, is not);
    - after scaling, every speed is finite and above 0, the fastest pair turns by at least the
      dtype's resolution (its epsilon) per position, else neighbouring positions get the same
      rotation, and by less than 2**24 radians over the window, else float32 angles lose whole turns.
    """
    rope_type = params["rope_type"]
    if not isinstance(rope_type, str) or rope_type not in SCALING_FIELDS:
        raise ValueError(f"{str(path)!r}: unsupported rope_type {rope_type!r}; supported: {', '.join(SCALING_FIELDS)}")
    for key in ("rope_theta", *SCALING_FIELDS[rope_type]):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{str(path)!r}: {key} (rotary embedding) must be a positive finite number, got {value!r}")
    if rope_type == "llama3" and params["low_freq_factor"] == params["high_freq_factor"]:
        raise ValueError(f"{str(path)!r}: rope low_freq_factor and high_freq_factor must differ (llama3 blends "
                         f"between them), both are {params['low_freq_factor']!r}")
    if window > FLOAT32_EXACT:
        raise ValueError(f"{str(path)!r}: max_position_embeddings {window} is above 2**24: positions are float32 "
                         f"in the rotary angles, and neighbouring ones would get the same rotation")
    plain = rope_inv_freq(head_dim, {"rope_type": "default", "rope_theta": params["rope_theta"]})
    if not (bool(torch.isfinite(plain).all()) and bool((plain > 0).all()) and len(set(plain.tolist())) == len(plain)):
        raise ValueError(f"{str(path)!r}: rope_theta {params['rope_theta']!r} gives rotary speeds "
                         f"{_span(plain)} per position in float32: they must be finite, above 0 and all different")
    speeds = rope_inv_freq(head_dim, params)
    fastest, resolution = float(speeds.max()), torch.finfo(dtype).eps
    if not (bool(torch.isfinite(speeds).all()) and bool((speeds > 0).all())
            and resolution <= fastest and fastest * window < FLOAT32_EXACT):
        fields = " / ".join(SCALING_FIELDS[rope_type])
        raise ValueError(f"{str(path)!r}: rope {fields + ' ' if fields else ''}({rope_type} scaling) gives rotary speeds {_span(speeds)} "
                         f"rad per position: they must be finite and above 0, the fastest at least {resolution:.2g} "
                         f"({dtype} resolution) and at most 2**24 / max_position_embeddings ({window})")


def _span(speeds: torch.Tensor) -> str:
    return f"{float(speeds.min()):.3g}..{float(speeds.max()):.3g}"
