"""Make ``megamoe_ep`` an accepted ``--moe-backend`` value in vLLM 0.32 - 0.34 (one mechanism in all).

vLLM has no registry for MoE backend names: ``vllm.config.kernel.MoEBackend`` is a ``Literal`` and
two things are derived from it — the argparse ``choices`` of ``--moe-backend`` (computed from the
``KernelConfig`` dataclass field's type, behind an ``lru_cache``) and the pydantic validator of
``KernelConfig.moe_backend`` (built once, when the class is defined). ``SpeculativeConfig`` has the
same field for draft models. We widen the field type on those config classes, rebuild their pydantic
validators and clear the argparse kwargs cache, then check that the name really validates, so a
future vLLM that changes any of this fails loudly here instead of silently not accepting the flag.

Everything else in vLLM compares ``moe_backend`` to fixed names, so an extra name is inert unless
the plugin's routed-experts hook sees it.
"""

from __future__ import annotations

from typing import Literal, get_args, get_origin

BACKEND_NAME = "megamoe_ep"


class BackendRegistrationError(RuntimeError):
    """vLLM's config classes did not accept the new backend name (unsupported vLLM internals)."""


def _widened(tp: object, name: str) -> object:
    """``Literal[...]`` (or ``Literal[...] | None``) with ``name`` added; other types unchanged."""
    if get_origin(tp) is Literal:
        args = get_args(tp)
        return tp if name in args else Literal[args + (name,)]  # type: ignore[valid-type]
    args = get_args(tp)
    if args and any(get_origin(a) is Literal for a in args):
        parts = [_widened(a, name) for a in args]
        out = parts[0]
        for p in parts[1:]:
            out = out | p  # type: ignore[operator]
        return out
    return tp


def _widen_field(cls: type, field: str, name: str) -> bool:
    """Widen ``cls.field``'s Literal type and rebuild its pydantic validator; True if changed."""
    import pydantic

    dc_field = cls.__dataclass_fields__[field]  # type: ignore[attr-defined]
    new_type = _widened(dc_field.type, name)
    if new_type is dc_field.type:
        return False
    dc_field.type = new_type
    cls.__annotations__[field] = new_type
    pydantic.dataclasses.rebuild_dataclass(cls, force=True)
    return True


def add_moe_backend(name: str = BACKEND_NAME) -> None:
    """Idempotently make ``name`` a valid ``KernelConfig.moe_backend`` / ``--moe-backend`` value."""
    from vllm.config.kernel import KernelConfig

    targets = [(KernelConfig, "moe_backend")]
    try:
        from vllm.config.speculative import SpeculativeConfig

        if "moe_backend" in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
            targets.append((SpeculativeConfig, "moe_backend"))
    except ImportError:
        pass

    changed = False
    for cls, field in targets:
        try:
            changed |= _widen_field(cls, field, name)
        except Exception as exc:  # noqa: BLE001 - any failure here means unsupported internals
            raise BackendRegistrationError(
                f"[megamoe] could not add {name!r} to {cls.__name__}.{field}: {exc}"
            ) from exc

    if changed:
        # The argparse kwargs of config classes are cached; drop a stale entry computed before us.
        from vllm.engine import arg_utils

        cache_clear = getattr(getattr(arg_utils, "_compute_kwargs", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()

    try:
        KernelConfig(moe_backend=name)
    except Exception as exc:  # noqa: BLE001
        raise BackendRegistrationError(
            f"[megamoe] KernelConfig still rejects moe_backend={name!r} after registration: {exc}"
        ) from exc


def is_selected(moe_backend: object) -> bool:
    return moe_backend == BACKEND_NAME
