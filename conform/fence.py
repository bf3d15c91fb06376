"""--patch-fence: the seed PR's reader fence, applied to the fork's parsed class.

The PR (kvcache-ai/sglang pull 102, see the seed) describes two changes to the staging loop:
before the first write of a load every rank drains its copies and joins a TP
barrier; before rank 0 refills a slot (idx > 0 and a next write exists) every
rank synchronizes its own copy event of expert idx-1 and joins a TP barrier.
This module finds the loop in the parsed method (rank 0's
``events[idx - 1].synchronize()`` inside ``if do_write:``) and rewrites it that
way; the fence functions are moetrace's, written from that description.
"""

from __future__ import annotations

import ast
import copy

from moetrace.conform.source import ForkError

METHODS = ("_prepare_weight_fp8", "_prepare_weight_fp8_channel", "_prepare_weight_bf16")
FIRST_FENCE, READER_FENCE = "__moetrace_first_write_fence__", "__moetrace_reader_fence__"


def _is_name(node, name) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _calls(node, attr: str) -> bool:
    return any(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) == attr or _is_name(n.func, attr))
               for n in ast.walk(node))


def _own_event_wait(node) -> tuple[str, str] | None:
    """`if idx > 0: events[idx - 1].synchronize()` -> (events name, idx name)."""
    if not (isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Expr)):
        return None
    call = node.body[0].value
    if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "synchronize"):
        return None
    sub = call.func.value
    if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) and isinstance(sub.slice, ast.BinOp):
        idx = sub.slice.left
        if isinstance(idx, ast.Name):
            return sub.value.id, idx.id
    return None


def _remove_own_wait(stmts: list) -> tuple[list, tuple[str, str] | None]:
    out, found = [], None
    for s in stmts:
        hit = _own_event_wait(s)
        if hit and found is None:
            found = hit
            continue
        if isinstance(s, ast.If) and found is None:
            s.body, found = _remove_own_wait(s.body)
        out.append(s)
    return out, found


def _fence_loop(loop: ast.For, method: str) -> bool:
    for i, stmt in enumerate(loop.body):
        if not (isinstance(stmt, ast.If) and _is_name(stmt.test, "do_write")):
            continue
        body, hit = _remove_own_wait(stmt.body)
        if hit is None:
            continue
        events, idx = hit
        split = next((k + 1 for k, s in enumerate(body) if _calls(s, "sync_write_weight_scale_to_buffer")), None)
        if split is None:
            raise ForkError(f"--patch-fence: {method}: no sync_write before rank 0's event wait")
        n_expr = loop.iter.args[0] if isinstance(loop.iter, ast.Call) and loop.iter.args else None
        if n_expr is None:
            raise ForkError(f"--patch-fence: {method}: the staging loop does not enumerate an expert list")
        fence = ast.parse(f"{READER_FENCE}({idx}, len(X), {events})").body[0]
        fence.value.args[1].args[0] = n_expr
        first = ast.If(test=ast.Name("do_write", ast.Load()), body=body[:split], orelse=[])
        rest = ast.If(test=ast.Name("do_write", ast.Load()), body=body[split:], orelse=[])
        loop.body[i:i + 1] = [first, fence] + ([rest] if rest.body else [])
        return True
    return False


def _patch_method(fn: ast.FunctionDef) -> None:
    loops = [s for s in fn.body if isinstance(s, ast.For) and _calls(s, "sync_write_weight_scale_to_buffer")]
    if len(loops) != 1 or not _fence_loop(loops[0], fn.name):
        raise ForkError(f"--patch-fence: {fn.name} has no staging loop with rank 0's own "
                              f"`events[idx - 1].synchronize()` inside `if do_write:` (the shape the seed PR "
                              f"patches); patch your fork yourself and run conform without --patch-fence")
    loop_at = fn.body.index(loops[0])
    first_write = next((k for k, s in enumerate(fn.body[:loop_at]) if _calls(s, "submit_write_expert")), None)
    if first_write is None:
        raise ForkError(f"--patch-fence: {fn.name}: no first submit_write_expert before the staging loop")
    fn.body.insert(first_write, ast.parse(f"{FIRST_FENCE}()").body[0])


def patch_fence(cls_node: ast.ClassDef, ns: dict) -> list[str]:
    """Rewrite the three staging methods in place; add the fence functions to ns."""
    torch, dist, tp_group = ns["torch"], ns["dist"], ns["get_tp_group"]

    def collective_fence():
        if dist.is_initialized() and tp_group().world_size > 1:  # TP1 stays collective-free
            dist.barrier(group=tp_group().device_group)

    def first_write_fence():
        torch.cuda.synchronize()  # prior readers of every slot, on every rank
        collective_fence()

    def reader_fence(idx, n, events):
        if idx > 0 and idx + 1 < n:  # a next write will refill the slot expert idx-1 was read from
            events[idx - 1].synchronize()
            collective_fence()

    ns[FIRST_FENCE], ns[READER_FENCE] = first_write_fence, reader_fence
    done = []
    for fn in cls_node.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in METHODS:
            _patch_method(fn)
            done.append(fn.name)
    ast.fix_missing_locations(cls_node)
    return done


def check_patchable(cls_node: ast.ClassDef) -> list[str]:
    """Raise ForkError when --patch-fence cannot apply (before any process starts)."""
    return patch_fence(copy.deepcopy(cls_node), {"torch": None, "dist": None, "get_tp_group": None})
