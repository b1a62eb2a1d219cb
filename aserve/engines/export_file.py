"""Loading a ``torch.export`` program (``.pt2``) so that nothing in the file runs as code.

Layer: ``engines``; runs where a model loads (an executor thread, a worker
process, the command line before the server starts). Never on the loop.

torch's own loader trusts the file it reads, and a crafted ``.pt2`` reaches
Python through more doors than its pickles (each one checked here with a file
that opened it, ``tests/test_hostile_model_files.py``):

- **pickles**: the sample inputs fall back to ``torch.load(weights_only=False)``
  when the safe load fails; weights and constants marked ``use_pickle`` are
  loaded with ``weights_only=False`` outright; "opaque" constants go to
  ``pickle.loads``; the pre-2.7 layout's ``serialized_*.pt`` members fall back
  the same way;
- **native code**: an AOTInductor member (``data/aotinductor/``) is a shared
  library that the loader ``dlopen``\\ s;
- **Python source**: a symbolic size (``expr_str``) goes to ``sympy.sympify``,
  which is ``eval``; the program's ``guards_code`` is pasted into a function
  and ``exec``\\ d; names (inputs, parameters, attributes, keyword arguments,
  the argument names of a pytree spec) are pasted unescaped into the Python
  that ``torch.fx`` writes for the graph and ``exec``\\ s; a node's target is
  any callable reachable from ``torch`` by attribute names.

So before torch reads the file, :func:`check_archive` reads it the way torch
will (through the same ``PyTorchFileReader``, and through ``zipfile`` for the
old layout) and refuses, naming the member and the field: an AOTInductor
member, an opaque object, any pickled member that does not load with
``weights_only=True`` (so torch's first, safe attempt is the one that
succeeds, and its ``use_pickle`` loads meet only what the safe load allowed),
a name that is not a plain dotted identifier, a symbolic size that is not a
plain arithmetic expression over sympy's and torch's size functions, a guard
that is not a comparison of input sizes, and a pytree spec naming anything but
plain containers and names. After the load, :func:`check_graph` allows only
registered operators as node targets (torch's verifier does as well; this does
not depend on it).

The file is opened once: the check and the load read the same open file, so
replacing the path between them changes nothing.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import keyword
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch


class UnsafeProgram(ValueError):
    """A ``.pt2`` that holds something aserve will not let torch run."""


# Names torch pastes into Python source (torch.fx codegen, guards): dotted identifiers.
_NAME = re.compile(r"[A-Za-z0-9_.]*")
# A node's target: an operator (torch.ops.NS.OP[.OVERLOAD]; OP may be a dunder, as in
# aten.__and__), a builtin torch serializes by module (_operator.add, math.trunc,
# torch.sym_max), or a registered extension ("#ns:op"). torch resolves a target by
# attribute names from its module, so no other dunder may lead anywhere.
_PART = r"(?!__)[A-Za-z0-9_]+"
_TARGET = re.compile(
    rf"torch\.ops\.{_PART}\.[A-Za-z0-9_]+(\.{_PART})?"
    rf"|(_operator|math|torch)\.{_PART}"
    r"|#[A-Za-z0-9_.]+:[A-Za-z0-9_.]+"
)

# The members torch.export.save writes (names without the archive's top folder).
_RECORD = re.compile(
    r"models/[A-Za-z0-9_]+\.json"
    r"|data/(weights|constants|sample_inputs)/[A-Za-z0-9_.\-]+"
    r"|extra/[^\x00]+|archive_format|archive_version|byteorder|\.data/[A-Za-z0-9_.]+"
)
# The pre-2.7 layout's members torch hands to torch.load (trying weights_only=False
# when the safe load fails); the two .json names are what an older torch wrote there.
_OLD_PICKLED = frozenset({
    "serialized_state_dict.pt", "serialized_constants.pt", "serialized_example_inputs.pt",
    "serialized_state_dict.json", "serialized_constants.json",
})  # fmt: skip

# Fields whose strings torch never pastes into code (it repr()s or only stores them).
_FREE_KEYS = frozenset({"metadata", "as_string", "as_strings", "torch_version", "stack_trace"})

# Containers a pytree spec may name (what torch.export writes for plain Python values).
_SPEC_TYPES = frozenset({
    None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
    "collections.defaultdict", "collections.namedtuple",
    "torch.fx.immutable_collections.immutable_list",
    "torch.fx.immutable_collections.immutable_dict",
})  # fmt: skip

_MAX_EXPR_CHARS = 10_000
_MAX_DIGITS = 30

# sympy's own classes and functions that torch's size expressions are printed with
# (srepr: "Add(Symbol('s0', integer=True, positive=True), Integer(-2))"; str: "s0 - 2").
_SYMPY_CALLS = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan",
    "GreaterThan", "Equality", "Unequality", "And", "Or", "Not", "Xor", "Piecewise",
    "ExprCondPair", "ITE", "floor", "ceiling", "sqrt", "sign", "Tuple",
})  # fmt: skip

_EXPR_TOKEN = re.compile(
    r"""(?P<ws>\s+)
    |(?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
    |(?P<string>'[A-Za-z0-9_.+-]*')
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op>\*\*|//|==|!=|<=|>=|[-+*/%<>(),=&|~])""",
    re.VERBOSE,
)

# Guards call only these on an input (L['x'].size()[0]), math's pure functions, torch.sym_*.
_TENSOR_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_MATH_FUNCS = frozenset({"floor", "ceil", "trunc", "sqrt", "log", "log2", "exp", "fabs"})
_BUILTIN_FUNCS = frozenset({"abs", "min", "max", "int", "float", "bool", "round"})


@functools.cache
def _torch_sympy_functions() -> frozenset[str]:
    """The size functions torch defines (FloorDiv, CeilToInt, ...): what its deserializer
    hands sympify as locals and its guards run with."""
    import inspect

    import sympy
    from torch.utils._sympy import functions

    return frozenset(
        name
        for name, obj in vars(functions).items()
        if inspect.isclass(obj) and issubclass(obj, sympy.Basic)
    ) | {"IsNonOverlappingAndDenseIndicator", "cast_symbool_to_symint_guardless"}


def load_exported_program(path: Path) -> Any:
    """The ``ExportedProgram`` in ``path``, checked before and after torch loads it.

    Raises :class:`UnsafeProgram` naming what was refused, ``FileNotFoundError``,
    or torch's own error for a file that is not a program at all. Blocking.
    """
    with path.open("rb") as f:
        check_archive(f, path.name)
        f.seek(0)
        program = torch.export.load(f)
    check_graph(program, path.name)
    return program


def check_archive(f: BinaryIO, label: str) -> None:
    """Refuse a ``.pt2`` whose members torch would run as code (see the module doc)."""
    try:
        reader = torch._C.PyTorchFileReader(f)
        records = list(reader.get_all_records())
    except RuntimeError:  # not torch's zip layout: only the old zipfile path can read it
        reader, records = None, []
    if reader is not None:
        _check_records(reader, records, label)
    f.seek(0)
    _check_old_layout(f, label)


def _check_records(reader: Any, records: list[str], label: str) -> None:
    from torch.export.pt2_archive import constants as c

    pickled: set[str] = set()
    for name in records:
        if name.startswith(c.AOTINDUCTOR_DIR):
            raise UnsafeProgram(
                f"{label}: member '{name}' is AOTInductor compiled code (a shared library), "
                "which aserve does not load; save the program with torch.export.save"
            )
        if not _RECORD.fullmatch(name):
            # torch reads every member under models/ as a program, naming it by cutting
            # ".json" off whatever the name ends with: only the layout torch writes passes.
            raise UnsafeProgram(
                f"{label}: member '{name}' is not part of the layout torch.export.save "
                "writes; aserve does not load it"
            )
        if name.startswith(c.SAMPLE_INPUTS_DIR) or (
            name.startswith((c.WEIGHTS_DIR, c.CONSTANTS_DIR)) and name.endswith(".pt")
        ):
            pickled.add(name)  # sample inputs; the legacy single-file weights and constants
        if name.startswith(c.MODELS_DIR) and name.endswith(".json"):
            _check_value(_read_json(reader.get_record(name), label, name), label, name)
    for name in records:
        for base, kind in ((c.WEIGHTS_DIR, "weights"), (c.CONSTANTS_DIR, "constants")):
            if name.startswith(base) and name.endswith(f"_{kind}_config.json"):
                payloads = _read_json(reader.get_record(name), label, name)
                _check_value(payloads, label, name)
                pickled |= _pickled_payloads(payloads, base, label, name, c)
    for name in sorted(pickled):
        if not reader.has_record(name):
            continue  # torch fails on its own with "not found"
        _check_weights_only(reader.get_record(name), label, name)


def _pickled_payloads(payloads: Any, base: str, label: str, record: str, c: Any) -> set[str]:
    """The members a weights/constants config makes torch unpickle."""
    entries = payloads.get("config") if isinstance(payloads, dict) else None
    if not isinstance(entries, dict):
        return set()
    out = set()
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            continue
        path_name = meta["path_name"]
        if path_name.startswith(c.OPAQUE_OBJ_FILENAME_PREFIX):
            raise UnsafeProgram(
                f"{label}: {record} makes constant '{fqn}' an opaque Python object, "
                "which torch unpickles with no restriction; aserve does not load it"
            )
        if meta.get("use_pickle"):
            out.add(base + path_name)
    return out


def _check_old_layout(f: BinaryIO, label: str) -> None:
    """torch falls back to the pre-2.7 layout (read with zipfile) when the new one fails."""
    try:
        archive = zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        return  # torch cannot read it either
    with archive:
        # Every entry of those names, a name given twice included: torch reads them all.
        for info in archive.infolist():
            if info.filename in _OLD_PICKLED:
                _check_weights_only(archive.read(info), label, info.filename)
            elif info.filename == "serialized_exported_program.json":
                program = _read_json(archive.read(info), label, info.filename)
                _check_value(program, label, info.filename)


def _read_json(data: bytes, label: str, name: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise UnsafeProgram(f"{label}: member '{name}' is not JSON torch can read: {exc}") from None


def _check_weights_only(data: bytes, label: str, name: str) -> None:
    try:
        torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # the safe unpickler's refusals come as several types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeProgram(
            f"{label}: member '{name}' is a pickle that does not load with weights_only=True "
            f"({first[:200]}); aserve never unpickles anything else. Re-export the program "
            "from plain tensors"
        ) from None


def _check_value(root: Any, label: str, record: str) -> None:
    """Walk a JSON document of torch's export schema; refuse what would become code."""
    for path, key, value in _walk(root):
        where = f"{label}: {record} {path}"
        if key in _FREE_KEYS:
            continue
        if key == "expr_str":
            check_expression(value, where)
        elif key == "guards_code":
            if not isinstance(value, list):
                raise UnsafeProgram(f"{where} is not a list of guards")
            for i, guard in enumerate(value):
                check_guard(guard, f"{where}[{i}]")
        elif key in ("in_spec", "out_spec"):
            _check_treespec(value, where)
        elif key in ("target", "as_operator") and isinstance(value, str):
            if not _TARGET.fullmatch(value):
                raise UnsafeProgram(
                    f"{where} names the operator {value[:120]!r}, not an operator name"
                )
        else:
            _check_plain(value, where)


def _walk(root: Any) -> Iterator[tuple[str, str, Any]]:
    """``(path, key, value)`` for every field; a field's children are not visited when the
    key is one of the special kinds, so those are checked whole. Dict keys are names too."""
    stack: list[tuple[str, str, Any]] = [("", "", root)]
    special = _FREE_KEYS | {"expr_str", "guards_code", "in_spec", "out_spec"}
    while stack:
        path, key, value = stack.pop()
        if key in special:
            yield path, key, value
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                if key == "range_constraints":  # keyed by size expressions ("2*s0")
                    check_expression(k, f"{path} key")
                elif not _NAME.fullmatch(k):
                    raise UnsafeProgram(f"{path or 'the document'} has the key {k[:120]!r}")
                stack.append((f"{path}.{k}", k, v))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((f"{path}[{i}]", key, v))
        else:
            yield path, key, value


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, str) and not _NAME.fullmatch(value):
        raise UnsafeProgram(
            f"{where} is {value[:120]!r}, not a plain name (letters, digits, '_' and '.'): "
            "torch pastes names into the Python it generates for the graph"
        )


def _check_treespec(value: Any, where: str) -> None:
    """A pytree spec: a JSON string of ``[protocol, node]``; a node names its container type
    and holds a JSON ``context`` (a dict's keys) and its children."""
    if not isinstance(value, str):
        raise UnsafeProgram(f"{where} is not a pytree spec string")
    doc = _read_json(value.encode(), where, "spec")
    if not (isinstance(doc, list) and len(doc) == 2):
        raise UnsafeProgram(f"{where} is not a pytree spec ([protocol, node])")
    stack = [doc[1]]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            raise UnsafeProgram(f"{where} holds a spec node that is not an object")
        kind = node.get("type")
        if kind not in _SPEC_TYPES:
            raise UnsafeProgram(f"{where} names the container type {str(kind)[:120]!r}")
        context = node.get("context")
        if context is not None:
            if not isinstance(context, str):
                raise UnsafeProgram(f"{where} holds a spec context that is not a string")
            for _, _, leaf in _walk(_read_json(context.encode(), where, "spec context")):
                _check_plain(leaf, f"{where} (a spec context)")
        children = node.get("children_spec", [])
        if not isinstance(children, list):
            raise UnsafeProgram(f"{where} holds spec children that are not a list")
        stack.extend(children)


def check_expression(text: Any, where: str) -> None:
    """A symbolic size as torch prints it; refused unless it is arithmetic over numbers,
    symbols, and calls of sympy's and torch's size functions (sympify ``eval``\\ s it)."""
    if not isinstance(text, str):
        raise UnsafeProgram(f"{where} is not a string")
    if len(text) > _MAX_EXPR_CHARS:
        raise UnsafeProgram(f"{where} is {len(text)} characters, over {_MAX_EXPR_CHARS}")
    calls = _SYMPY_CALLS | _torch_sympy_functions()
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None:
            raise UnsafeProgram(f"{where}: {text[:120]!r} holds {text[pos]!r} at {pos}")
        pos = m.end()
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup or "", m.group()))
    for i, (kind, tok) in enumerate(tokens):
        after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        before_kind, before = tokens[i - 1] if i else ("", "")
        refuse = None
        if kind == "name":
            if "__" in tok or (keyword.iskeyword(tok) and tok not in ("True", "False", "None")):
                refuse = f"the name {tok!r}"
            elif after == "(" and tok not in calls:
                refuse = f"a call of {tok!r}"
        elif kind == "number" and len(tok.split(".")[0].split("e")[0]) > _MAX_DIGITS:
            refuse = f"a number of more than {_MAX_DIGITS} digits"
        elif tok == "(" and (before_kind in ("number", "string") or before == ")"):
            refuse = "a call of something that is not a function name"
        elif kind == "string" and (before not in ("(", ",") or after not in (",", ")")):
            refuse = "a string outside a call's arguments"
        if refuse:
            raise UnsafeProgram(f"{where}: {text[:120]!r} holds {refuse}, not a size expression")


def check_guard(text: Any, where: str) -> None:
    """One of the program's guards, as torch writes them (``L['x'].size()[0] <= 64``);
    refused unless it only compares and computes with input sizes (torch ``exec``\\ s it)."""
    if not isinstance(text, str) or len(text) > _MAX_EXPR_CHARS:
        raise UnsafeProgram(f"{where} is not a guard of at most {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise UnsafeProgram(f"{where}: {text[:120]!r} is not a Python expression") from None
    funcs = _BUILTIN_FUNCS | _SYMPY_CALLS | _torch_sympy_functions()
    allowed = (
        ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Constant,
        ast.Subscript, ast.Call, ast.Attribute, ast.Name, ast.Load,
        ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Invert,
        ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
        ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift, ast.RShift,
        ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    )  # fmt: skip
    for node in ast.walk(tree):
        bad = None
        if not isinstance(node, allowed):
            bad = type(node).__name__
        elif isinstance(node, ast.Constant) and not (
            isinstance(node.value, (int, float, bool))
            or (isinstance(node.value, str) and _NAME.fullmatch(node.value))
        ):
            bad = f"the constant {node.value!r}"[:80]
        elif isinstance(node, ast.Name) and node.id not in ("L", "math", "torch", *funcs):
            bad = f"the name {node.id!r}"
        elif isinstance(node, ast.Call):
            if node.keywords or not _guard_callee_ok(node.func, funcs):
                bad = "a call of something that is not a size method or function"
        elif isinstance(node, ast.Attribute) and not _guard_attribute_ok(node):
            bad = f"the attribute {node.attr!r}"
        if bad:
            raise UnsafeProgram(f"{where}: {text[:120]!r} holds {bad}, not a guard on sizes")


def _guard_callee_ok(func: ast.expr, funcs: frozenset[str]) -> bool:
    if isinstance(func, ast.Name):
        return func.id in funcs
    return isinstance(func, ast.Attribute) and _guard_attribute_ok(func)


def _guard_attribute_ok(node: ast.Attribute) -> bool:
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id == "math":
        return node.attr in _MATH_FUNCS
    if isinstance(owner, ast.Name) and owner.id == "torch":
        return node.attr.startswith("sym_") and "__" not in node.attr
    return node.attr in _TENSOR_METHODS and isinstance(owner, (ast.Subscript, ast.Call))


def check_graph(program: Any, label: str) -> None:
    """Every node of every graph in the loaded program calls a registered operator."""
    import operator

    from torch._export.serde import serialize

    allowed_types = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
    # The size arithmetic torch writes as builtins (operator.add, torch.sym_max, ...).
    builtins = {operator.getitem, *getattr(serialize, "_SYM_OPS", ())}
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            target = node.target
            if node.op != "call_function" or not (
                isinstance(target, allowed_types) or target in builtins
            ):
                raise UnsafeProgram(
                    f"{label}: graph node '{node.name}' calls {node.op} {target!r}, "
                    "not a registered operator; aserve does not run it"
                )
