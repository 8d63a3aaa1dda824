"""``package.module:name`` specs (a model factory, a data transform) resolved to a callable, or one clear error."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from steadytrain._io import brief
from steadytrain._text import error_text
from steadytrain.errors import UserError

__all__ = ["SPEC", "import_callable"]

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def import_callable(spec: Any, key: str, forms: str) -> Callable[..., Any]:
    """The callable ``spec`` names; a UserError naming ``key``, the spec and ``forms`` (what to write) otherwise.

    Example:
        >>> import_callable("os.path:join", "data.transform", "package.module:function")("a", "b")
        'a/b'
    """
    if not isinstance(spec, str) or not SPEC.match(spec):
        raise UserError(f"{key}={brief(spec)}: {forms}")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise UserError(
            f"{key}={spec!r}: cannot import {module_name!r} ({error_text(err)}); is it on PYTHONPATH?"
        ) from None
    except Exception as err:  # the user's module raised while it was imported: their code, their error
        raise UserError(
            f"{key}={spec!r}: importing {module_name!r} raised {type(err).__name__}: {error_text(err)}"
        ) from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise UserError(f"{key}={spec!r}: {module_name} has no callable {attr!r}")
    return found
