"""The type stubs declare exactly the module's public names, classes' members included."""

import ast
import pathlib

import kvshard

STUB = pathlib.Path(kvshard.__file__).with_name("__init__.pyi")
ALIASES = {"Tokens", "ModelLike", "ParallelLike", "HardwareLike", "__version__"}


def stub_names():
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            names = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    names.add(item.target.id)
            members[node.name] = names
        elif isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            top.update(t.id for t in targets)
    return top - ALIASES, members


def public_members(cls):
    # __init__ is left out: pybind11 gives every class one (raising when none is bound); the
    # tests call each constructor.
    own = set(vars(cls)) - {"__init__"}
    dunders = {"__eq__", "__contains__", "__len__"}
    return {n for n in own if not n.startswith("_") or n in dunders}


def test_stub_lists_every_public_name():
    top, _ = stub_names()
    assert top == set(kvshard.__all__)


def test_stub_lists_every_member():
    _, members = stub_names()
    for name, declared in members.items():
        cls = getattr(kvshard, name)
        if issubclass(cls, Exception):
            continue
        assert public_members(cls) == declared, name
