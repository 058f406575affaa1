"""Engine arguments raypd owns, lifted out of `engine_kwargs` into raypd's own fields.

The few engine arguments raypd needs to know itself (model, dtype, max_model_len, TP/PP/DCP
sizes, block size) have one home: raypd's fields (`actors.engine.config`, `serving.config`).
Written as engine_kwargs (shared, or a role's) they are moved there; a contradiction is refused.
Pure: no vLLM import, so the config layer imports it anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# vLLM engine argument -> the raypd field that holds it (one source of truth).
OWNED_KWARGS: dict[str, str] = {
    "model": "model", "dtype": "dtype", "max_model_len": "max_model_len",
    "tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
    "decode_context_parallel_size": "dcp_size", "block_size": "block_size",
}
GROUP_FIELDS = frozenset({"tp_size", "pp_size", "dcp_size", "block_size"})  # per role in a deployment
DEPLOYMENT_FIELDS = frozenset({"model", "dtype", "max_model_len"})  # one value for both roles
# Engine arguments raypd refuses, with what to use instead.
REFUSED_KWARGS: dict[str, str] = {
    "data_parallel_size": "raypd scales an engine pool with prefill.count / decode.count",
}


class OwnedKwargError(ValueError):
    """An engine_kwargs entry contradicts the raypd field that owns it."""


def lift_owned_kwargs(data: dict[str, Any], kwargs: dict[str, Any], fields: frozenset[str], where: str,
                      explicit: dict[str, str]) -> dict[str, Any]:
    """Move the owned engine arguments of `kwargs` that map to `fields` into `data`.

    `explicit` maps a raypd field to where the user (or an earlier kwargs source)
    set it; a different value is a contradiction. Returns what is left of `kwargs`,
    with vLLM's spelling of the keys (`max-num-seqs` -> `max_num_seqs`).
    """
    rest = {}
    for key, value in kwargs.items():
        name = key.replace("-", "_")
        if name in REFUSED_KWARGS:
            raise OwnedKwargError(f"{where}.{key} is not supported: {REFUSED_KWARGS[name]}")
        target = OWNED_KWARGS.get(name)
        if target is None or target not in fields:
            rest[name] = value
            continue
        if target in explicit and data.get(target) != value:
            raise OwnedKwargError(
                f"{where}.{key}={value!r} contradicts {explicit[target]}={data.get(target)!r}: "
                f"set it once (raypd keeps it in `{target}`)")
        data[target] = value
        explicit.setdefault(target, f"{where}.{key}")
    return rest



def lift_deployment_kwargs(data: dict[str, Any], roles: Iterable[str]) -> dict[str, Any]:
    """A deployment mapping with the owned engine arguments of its shared `engine_kwargs` and of
    each role's moved into raypd's fields (a role's own before the shared ones); the rest of each
    `engine_kwargs` stays, in vLLM's spelling."""
    data = dict(data)
    explicit = {f: f for f in DEPLOYMENT_FIELDS if f in data}
    shared = lift_owned_kwargs(data, dict(data.get("engine_kwargs") or {}), DEPLOYMENT_FIELDS,
                               "engine_kwargs", explicit)
    shared_group = {k: v for k, v in shared.items() if OWNED_KWARGS.get(k) in GROUP_FIELDS}
    for role in roles:
        group = data.get(role)
        if group is not None and not isinstance(group, dict):
            continue  # pydantic reports the type error
        group = dict(group or {})
        own = {f: f"{role}.{f}" for f in GROUP_FIELDS if f in group}
        kwargs = lift_owned_kwargs(data, dict(group.get("engine_kwargs") or {}), DEPLOYMENT_FIELDS,
                                   f"{role}.engine_kwargs", explicit)
        set_by_role = {OWNED_KWARGS[k] for k in kwargs if OWNED_KWARGS.get(k) in GROUP_FIELDS}
        kwargs = lift_owned_kwargs(group, kwargs, GROUP_FIELDS, f"{role}.engine_kwargs", own)
        lift_owned_kwargs(group, {k: v for k, v in shared_group.items() if OWNED_KWARGS[k] not in set_by_role},
                          GROUP_FIELDS, "engine_kwargs", own)
        if "engine_kwargs" in group or kwargs:
            group["engine_kwargs"] = kwargs
        if group or role in data:
            data[role] = group
    if "engine_kwargs" in data or shared:
        data["engine_kwargs"] = {k: v for k, v in shared.items() if k not in shared_group}
    return data
