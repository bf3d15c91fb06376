"""--patch-fence: the seed PR's reader fence, derived from the installed class's AST.

The PR (kvcache-ai/sglang pull 102, see the seed) describes two changes to a staging
loop: before the first write of a load every rank drains its copies and joins a TP
barrier; before rank 0 refills a slot, every rank synchronizes its own copy event of
the expert last read from that slot and joins a TP barrier.

Nothing here names the fork's lines. In the staging method that ``load`` dispatches
the format under test to, this module finds
- the writes: calls of ``submit_write_weight_scale_to_buffer`` and of the local
  functions that make them (``submit_write_expert`` in 0.5.2-0.7.2);
- the staging loop: the ``for`` that refills a slot (a write inside it) and holds
  the reader wait, ``<events>[<i> - 1].synchronize()`` (rank 0's own, in the fork);
- the first write: the method-level statement before the loop that makes one.
It then inserts, in the fork's own names (``torch``, ``dist``, ``get_tp_group``, the
loop's index, count and events list), ``torch.cuda.synchronize()`` plus a TP barrier
before the first write, and ``if i > 0 and i + 1 < n: events[i - 1].synchronize()``
plus a TP barrier before the loop statement that refills (skipped when no later
write reuses the slot; a TP1 run stays collective-free). The publication barriers
and rank 0's own wait stay. ``patch_diff`` is what changed, as a unified diff.
"""

from __future__ import annotations

import ast
import copy
import difflib
from dataclasses import dataclass

from moetrace.conform.fork import ForkError

WRITE = "submit_write_weight_scale_to_buffer"
NAMES = ("torch", "dist", "get_tp_group")  # module-level names the inserted fence reads


@dataclass(frozen=True)
class Loop:
    node: ast.For
    index: str  # the loop's position variable
    count: ast.expr  # how many experts it stages
    events: str  # the copy-event list the reader wait reads


def _called(node: ast.AST) -> set[str]:
    """Names of functions and methods called in node."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def writers(fn: ast.FunctionDef) -> set[str]:
    """The native write and the local functions that call it (transitively)."""
    local = {n.name: n for n in ast.walk(fn) if isinstance(n, ast.FunctionDef) and n is not fn}
    found, grew = {WRITE}, True
    while grew:
        grew = False
        for name, node in local.items():
            if name not in found and _called(node) & found:
                found.add(name)
                grew = True
    return found


def _makes_write(node: ast.AST, write: set[str]) -> bool:
    """A statement that calls a writer (a nested def that only defines one does not)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return False
    if isinstance(node, ast.Call):
        f = node.func
        if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in write:
            return True
    return any(_makes_write(c, write) for c in ast.iter_child_nodes(node))


def reader_wait(node: ast.AST) -> tuple[str, str] | None:
    """``<events>[<i> - 1].synchronize()`` in node -> (events, i)."""
    for n in ast.walk(node):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "synchronize"):
            continue
        sub = n.func.value
        if (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) and isinstance(sub.slice, ast.BinOp)
                and isinstance(sub.slice.op, ast.Sub) and isinstance(sub.slice.left, ast.Name)
                and isinstance(sub.slice.right, ast.Constant) and sub.slice.right.value == 1):
            return sub.value.id, sub.slice.left.id
    return None


def _count(loop: ast.For, index: str) -> ast.expr | None:
    """How many iterations: ``enumerate(X)`` -> ``len(X)``; ``range(N)`` -> ``N``."""
    it = loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args:
        if it.func.id == "enumerate" and isinstance(loop.target, ast.Tuple) and \
                getattr(loop.target.elts[0], "id", None) == index:
            return ast.Call(ast.Name("len", ast.Load()), [copy.deepcopy(it.args[0])], [])
        if it.func.id == "range" and len(it.args) == 1 and getattr(loop.target, "id", None) == index:
            return copy.deepcopy(it.args[0])
    return None


def staging_loop(fn: ast.FunctionDef) -> tuple[Loop, int, int]:
    """(the loop, its position in the method body, the position of the first write
    before it); ForkError naming what is not there."""
    write = writers(fn)
    loops = [(k, s) for k, s in enumerate(fn.body) if isinstance(s, ast.For) and _makes_write(s, write)]
    if len(loops) != 1:
        raise ForkError(f"--patch-fence: {fn.name}: {len(loops)} method-level loops refill a host slot "
                        f"(calls of {', '.join(sorted(write))}); the fence needs exactly one")
    at, node = loops[0]
    wait = reader_wait(node)
    if wait is None:
        raise ForkError(f"--patch-fence: {fn.name}: its staging loop has no reader wait "
                        f"(`<events>[<i> - 1].synchronize()`), the point the seed PR fences")
    events, index = wait
    count = _count(node, index)
    if count is None:
        raise ForkError(f"--patch-fence: {fn.name}: the reader wait's index {index!r} is not the staging loop's "
                        f"position (enumerate(...) or range(n))")
    first = next((k for k, s in enumerate(fn.body[:at]) if _makes_write(s, write)), None)
    if first is None:
        raise ForkError(f"--patch-fence: {fn.name}: no first write before the staging loop")
    return Loop(node, index, count, events), at, first


def _barrier() -> ast.stmt:
    return ast.parse("if dist.is_initialized() and get_tp_group().world_size > 1:\n"
                     "    dist.barrier(group=get_tp_group().device_group)").body[0]


def _reader_fence(loop: Loop) -> ast.stmt:
    fence = ast.parse(f"if {loop.index} > 0 and {loop.index} + 1 < N:\n"
                      f"    {loop.events}[{loop.index} - 1].synchronize()").body[0]
    fence.test.values[1].comparators[0] = copy.deepcopy(loop.count)
    fence.body.append(_barrier())
    return fence


def fence_method(fn: ast.FunctionDef) -> None:
    """Insert both fences into fn, in place."""
    loop, at, first = staging_loop(fn)
    write = writers(fn)
    k = next(i for i, s in enumerate(loop.node.body) if _makes_write(s, write))  # the statement that refills
    loop.node.body.insert(k, _reader_fence(loop))
    fn.body[first:first] = [ast.parse("torch.cuda.synchronize()").body[0], _barrier()]


def patch_fence(cls_node: ast.ClassDef, methods: list[str], free: frozenset | set = frozenset(NAMES)) -> list[str]:
    """Fence each named method of the class (in place); `free`: the module-level names
    the compiled class can read (the fence reads torch, dist, get_tp_group)."""
    lacking = [n for n in NAMES if n not in free]
    if lacking:
        raise ForkError(f"--patch-fence: the fork's module does not give its class {', '.join(lacking)}, "
                        f"which the fence calls")
    fns = {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}
    for name in methods:
        if name not in fns:
            raise ForkError(f"--patch-fence: the class has no method {name}")
        fence_method(fns[name])
    ast.fix_missing_locations(cls_node)
    return list(methods)


def patch_diff(cls_node: ast.ClassDef, methods: list[str], free: frozenset | set = frozenset(NAMES),
               label: str = "kt_ep_wrapper.py") -> str:
    """What --patch-fence changes, as a unified diff of the methods (ast.unparse text:
    the fork's comments are not in it). Raises ForkError when it cannot apply."""
    after = copy.deepcopy(cls_node)
    patch_fence(after, methods, free)
    old = {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}
    new = {n.name: n for n in after.body if isinstance(n, ast.FunctionDef)}
    out = []
    for m in methods:
        out += difflib.unified_diff(ast.unparse(old[m]).splitlines(keepends=True),
                                    ast.unparse(new[m]).splitlines(keepends=True),
                                    f"a/{label}:SharedFullContext.{m}", f"b/{label}:SharedFullContext.{m}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in out)
