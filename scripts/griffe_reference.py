"""A griffe extension (mkdocs.yml, the python handler's ``extensions``) for the API
reference: it shows what a user calls, as ``help()`` does.

- Annotations are spelled from the runtime signature (``inspect.signature``, which
  the clients' methods set to the public one: ``Client.push`` returns ``int |
  list[Array]``, not the operation's ``Op[...]``), with each ``Literal`` alias
  spelled out with its values (``transport: Literal['auto', 'unary', 'stream']``,
  where griffe would show a bare ``Literal``) and ``Array`` as ``np.ndarray``.
- Docstrings that are not the object's are left out: a dataclass's generated one
  (its signature again) and a field's default value's type's (``str(object='')``).

The clients' private base (``ClientCore``) is left out where docs/reference.md shows
them (``show_bases: false``): removed here, it would take the inherited ``__init__``,
and with it the class's signature, along.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from typing import Any

import griffe
import numpy as np

_TOKEN = re.compile(r"""('[^']*'|"[^"]*")|\b([A-Za-z_]\w*)\b""")


def _aliases() -> dict[str, str]:
    """Names of the client's and wire layer's type aliases -> how to spell them."""
    spelled: dict[str, str] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(("onnxps.client", "onnxps.wire")):
            continue
        for attr, value in vars(module).items():
            origin = typing.get_origin(value)
            if origin is typing.Literal:
                values = ", ".join(repr(v) for v in typing.get_args(value))
                spelled[attr] = f"Literal[{values}]"
            elif origin is np.ndarray:
                spelled[attr] = "np.ndarray"
    return spelled


def spell(annotation: Any, aliases: dict[str, str]) -> str | None:
    """The annotation as a user reads it: aliases replaced, strings kept."""
    if annotation is inspect.Parameter.empty:
        return None
    text = (
        annotation
        if isinstance(annotation, str)
        else inspect.formatannotation(annotation)
    )

    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(1)
        return aliases.get(m.group(2), m.group(2))

    return _TOKEN.sub(one, text)


class PublicSignatures(griffe.Extension):
    """Runtime signatures, with the values of Literal aliases spelled out."""

    def on_function_instance(
        self, *, node: Any, func: griffe.Function, **kwargs: Any
    ) -> None:
        obj = getattr(node, "obj", None)
        if obj is None or not callable(obj):
            return
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            return
        aliases = _aliases()
        for parameter in func.parameters:
            runtime = signature.parameters.get(parameter.name)
            if runtime is not None:
                spelled = spell(runtime.annotation, aliases)
                if spelled is not None:
                    parameter.annotation = spelled
        returns = spell(signature.return_annotation, aliases)
        if returns is not None:
            func.returns = returns

    def on_attribute_instance(
        self, *, node: Any, attr: griffe.Attribute, **kwargs: Any
    ) -> None:
        parent = getattr(getattr(node, "parent", None), "obj", None)
        annotation = getattr(parent, "__annotations__", {}).get(attr.name)
        if isinstance(annotation, str):
            attr.annotation = spell(annotation, _aliases())
        if isinstance(attr.value, str) and "._" in attr.value:
            # a public alias of private modules' classes (OptimizerSpec): their
            # public names, as onnxps.client exports them
            attr.value = re.sub(r"\bonnxps\.\w+\._\w+\.", "", attr.value)
        # a field's default is inspected as its value: str's docstring is not the
        # field's (``mode: ... = 'standard'`` said "str(object='') -> str")
        value_doc = getattr(type(getattr(node, "obj", None)), "__doc__", None)
        if attr.docstring is not None and isinstance(value_doc, str):
            if attr.docstring.value == inspect.cleandoc(value_doc):
                attr.docstring = None

    def on_class_instance(self, *, node: Any, cls: griffe.Class, **kwargs: Any) -> None:
        obj = getattr(node, "obj", None)
        doc = getattr(obj, "__doc__", None) or ""
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{cls.name}("):
            cls.docstring = None  # dataclass's own: the signature again, quoted
