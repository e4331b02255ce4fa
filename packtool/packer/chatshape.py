"""A chat template rendered once per conversation *shape*, not once (or once per reply) per conversation.

The encoder finds each assistant reply by rendering the conversation and every prefix of it that ends before a
reply. Most templates only ever copy message text into their output: they print it (alone or joined with ``+`` or
``~``), test its type or whether it is empty, and never transform, measure, search or compare it. For such a
template the output for a conversation is the output for the same conversation with every text replaced by a
placeholder character, the placeholders then replaced by the texts. That "holed" rendering, and where each prefix
ends in it, depend only on the conversation's shape (its roles, which texts are empty, the parts of structured
contents), and shapes repeat across a dataset: so a sample costs a dictionary look-up and a string join, with
text and reply positions exactly those of the prefix renders.

:func:`copies_text_verbatim` proves the property from the template's Jinja syntax tree, failing closed: any
construct it does not know, and any use of message text it cannot prove harmless, makes it answer False, and the
encoder renders every sample as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes

#: Placeholders are private-use characters, one per text of a conversation: from Unicode's Supplementary Private
#: Use Area-A, and again from Area-B.
_BASES = (0xF0000, 0x100000)
_HOLES = 0xFFFE
#: Distinct shapes remembered (a shape costs a few hundred characters).
_CACHE_SHAPES = 4096

# What a value may hold, as far as message text goes. STRUCT: nothing of any text (the same value in the holed
# and the real rendering). TEXT: a string made of texts and STRUCT strings, or a STRUCT value. CONTENT: a
# message's content where contents may be lists of parts (else contents are TEXT); LIST: a content that is not a
# string (a list of parts, or STRUCT). MESSAGES, MESSAGE, PART: the conversation, one message, one part of a
# structured content (or STRUCT values). LOOP+kind: a for loop's ``loop`` over items of that kind.
# NAMESPACE: a ``namespace()`` (only its attributes may be used; their kinds are kept as ``name.attr``).
STRUCT, TEXT, CONTENT, LIST, MESSAGES, MESSAGE, PART, NAMESPACE, LOOP = (
    "struct", "text", "content", "list", "messages", "message", "part", "namespace", "loop:")

#: Tests whose answer is the same for a text and its placeholder (both are non-empty strings).
_TYPE_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence", "iterable", "number",
                         "integer", "float", "boolean", "true", "false", "callable"})
#: Filters of the message list whose result does not look into the messages.
_MESSAGES_FILTERS = {"length": STRUCT, "count": STRUCT, "list": MESSAGES, "first": MESSAGE, "last": MESSAGE}
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Unproven(Exception):
    """The template does something with message text that the proof does not cover."""


def _join(a: str, b: str) -> str:
    """The kind of a value that is either an ``a`` or a ``b``."""
    if a == b or b == STRUCT:
        return a
    if a == STRUCT:
        return b
    raise _Unproven(f"a value is both {a} and {b}")


def copies_text_verbatim(tree: nodes.Template, lists: bool) -> bool:
    """Whether the template (its parsed tree) uses the text of messages only by copying it into the output,
    testing its type, or testing whether it is empty. ``lists``: contents may be lists of ``{"type": ...}`` parts
    (a part's ``text`` is message text too); without, every content is a string."""
    try:
        _Proof(tree, lists).run()
    except _Unproven:
        return False
    return True


class _Proof:
    """A walk over the template that tracks, per variable, the kind of value it may hold (flow-insensitive
    within a loop body or a macro: kinds only ever widen), and fails at the first unproven use of text."""

    def __init__(self, tree: nodes.Template, lists: bool):
        self.tree, self.lists = tree, lists
        macros = list(tree.find_all(nodes.Macro))
        self.macros = {m.name: m for m in macros}
        if len(self.macros) < len(macros):
            raise _Unproven("a macro is defined twice")
        self.calls: dict[tuple, str] = {}
        self.active: set[tuple] = set()
        self.text_output = False

    def run(self) -> None:
        self.block(self.tree.body, {"messages": MESSAGES})

    # -- statements ---------------------------------------------------------------------------------------------
    def block(self, body: Iterable[nodes.Node], env: dict) -> None:
        for node in body:
            self.statement(node, env)

    def statement(self, n: nodes.Node, env: dict) -> None:
        if isinstance(n, nodes.Output):
            for e in n.nodes:
                kind = self.expr(e, env)
                if kind not in (STRUCT, TEXT):
                    raise _Unproven(f"prints a {kind}")
                self.text_output |= kind == TEXT
        elif isinstance(n, nodes.If):
            self.branches(n.test, n.body, list(n.elif_), n.else_, env)  # type: ignore[arg-type]
        elif isinstance(n, nodes.For):
            self.loop(n, env)
        elif isinstance(n, nodes.Assign):
            self.bind(n.target, self.expr(n.node, env), env)
        elif isinstance(n, nodes.ExprStmt):
            self.expr(n.node, env)
        elif isinstance(n, nodes.With):
            inner = dict(env)
            for target, value in zip(n.targets, n.values):
                self.bind(target, self.expr(value, env), inner)
            self.block(n.body, inner)
            self.merge(env, inner, skip=_stored_names(n.targets))
        elif isinstance(n, (nodes.Macro, nodes.Continue, nodes.Break)):
            pass  # a macro is proven where it is called
        else:  # blocks, includes, {% filter %}, {% call %}, {% set %}...{% endset %}, extensions
            raise _Unproven(f"{type(n).__name__} statement")

    def branches(self, test: nodes.Expr, body: list, elifs: list, else_: list, env: dict) -> None:
        self.truth(test, env)
        yes, no = self.narrowing(test, env, [body, elifs, else_])
        then_env = {**env, **yes}
        self.block(body, then_env)
        else_env = {**env, **no}
        if elifs:
            first = elifs[0]
            self.branches(first.test, first.body, elifs[1:], else_, else_env)
        else:
            self.block(else_, else_env)
        self.merge(env, then_env)
        self.merge(env, else_env)

    def narrowing(self, test: nodes.Expr, env: dict, scope: list) -> tuple[dict, dict]:
        """What ``X is string`` (or ``is not string``) says of a content X in each branch."""
        negated = isinstance(test, nodes.Not)
        inner = test.node if isinstance(test, nodes.Not) else test
        if not (isinstance(inner, nodes.Test) and inner.name == "string" and not inner.args):
            return {}, {}
        path = _path(inner.node)
        kind = self.expr(inner.node, env)
        if path is None or kind not in (CONTENT, TEXT) or env.get(path[0]) == NAMESPACE \
                or path[0] in _assigned_names(scope):
            return {}, {}
        yes, no = {path: TEXT}, {path: LIST if kind == CONTENT else STRUCT}
        return (no, yes) if negated else (yes, no)

    def loop(self, n: nodes.For, env: dict) -> None:
        if n.recursive:
            raise _Unproven("recursive loop")
        items = self.expr(n.iter, env)
        item = {MESSAGES: MESSAGE, LIST: PART, STRUCT: STRUCT}.get(items)
        if item is None:
            raise _Unproven(f"iterates over a {items}")
        targets = _stored_names([n.target])
        body = dict(env)
        for _ in range(8):  # until the kinds settle: a later iteration sees what an earlier one assigned
            before = dict(body)
            body["loop"] = LOOP + item
            self.bind(n.target, item, body, replace=True)
            if n.test is not None:
                self.truth(n.test, body)
            self.block(n.body, body)
            if body == before:
                break
        else:
            raise _Unproven("loop kinds do not settle")
        self.merge(env, body, skip=targets | {"loop"})
        else_env = dict(env)
        self.block(n.else_, else_env)
        self.merge(env, else_env)

    def bind(self, target: nodes.Node, kind: str, env: dict, replace: bool = False) -> None:
        if isinstance(target, nodes.Name):
            env[target.name] = kind if replace else _join(env.get(target.name, STRUCT), kind)
            for narrowed in [k for k in env if isinstance(k, tuple) and k[0] == target.name]:
                del env[narrowed]  # a narrowing of the old value
        elif isinstance(target, nodes.NSRef):
            if env.get(target.name) != NAMESPACE:
                raise _Unproven(f"{target.name} is not a namespace")
            key = f"{target.name}.{target.attr}"
            env[key] = _join(env.get(key, STRUCT), kind)
        elif isinstance(target, nodes.Tuple) and kind == STRUCT:
            for item in target.items:
                self.bind(item, STRUCT, env, replace)
        else:
            raise _Unproven(f"unpacks a {kind}")

    @staticmethod
    def merge(env: dict, other: dict, skip: Iterable[str] = ()) -> None:
        """Widen ``env`` by what ``other`` (a branch, a loop body) may have assigned; narrowings stay local."""
        skipped = set(skip)
        for key, kind in other.items():
            if isinstance(key, str) and key not in skipped:
                env[key] = _join(env.get(key, STRUCT), kind)

    # -- expressions --------------------------------------------------------------------------------------------
    def expr(self, n: nodes.Node, env: dict) -> str:
        path = _path(n)
        if path is not None and path in env:
            return env[path]
        if isinstance(n, (nodes.Const, nodes.TemplateData)):
            return STRUCT
        if isinstance(n, nodes.Name):
            kind = env.get(n.name, STRUCT)
            if kind == NAMESPACE:
                raise _Unproven(f"uses the namespace {n.name} as a value")
            return kind
        if isinstance(n, (nodes.List, nodes.Tuple)):
            self.structural(n.items, env)
            return STRUCT
        if isinstance(n, nodes.Dict):
            self.structural([x for pair in n.items for x in (pair.key, pair.value)], env)
            return STRUCT
        if isinstance(n, (nodes.Add, nodes.Concat)):
            operands = [n.left, n.right] if isinstance(n, nodes.Add) else n.nodes
            kinds = [self.expr(x, env) for x in operands]
            if any(k not in (STRUCT, TEXT) for k in kinds):
                raise _Unproven(f"joins a {kinds}")
            return TEXT if TEXT in kinds else STRUCT
        if isinstance(n, nodes.BinExpr) and not isinstance(n, (nodes.And, nodes.Or)):
            self.structural([n.left, n.right], env)  # arithmetic and % formatting
            return STRUCT
        if isinstance(n, (nodes.And, nodes.Or)):  # the value is one of the operands
            return _join(self.expr(n.left, env), self.expr(n.right, env))
        if isinstance(n, nodes.Not):
            self.truth(n.node, env)
            return STRUCT
        if isinstance(n, nodes.UnaryExpr):
            self.structural([n.node], env)
            return STRUCT
        if isinstance(n, nodes.CondExpr):
            self.truth(n.test, env)
            return _join(self.expr(n.expr1, env), self.expr(n.expr2, env) if n.expr2 is not None else STRUCT)
        if isinstance(n, nodes.Compare):
            return self.compare(n, env)
        if isinstance(n, nodes.Test):
            return self.test(n, env)
        if isinstance(n, nodes.Filter):
            return self.filter(n, env)
        if isinstance(n, nodes.Call):
            return self.call(n, env)
        if isinstance(n, (nodes.Getattr, nodes.Getitem)):
            return self.item(n, env)
        if isinstance(n, nodes.Slice):
            self.structural([x for x in (n.start, n.stop, n.step) if x is not None], env)
            return STRUCT
        if isinstance(n, (nodes.MarkSafe, nodes.MarkSafeIfAutoescape)):
            return self.expr(n.expr, env)
        raise _Unproven(f"{type(n).__name__} expression")

    def truth(self, n: nodes.Node, env: dict) -> None:
        """Check an expression of which only the truth is used: a text and its placeholder are both non-empty."""
        if isinstance(n, (nodes.And, nodes.Or)):
            self.truth(n.left, env)
            self.truth(n.right, env)
        elif isinstance(n, nodes.Not):
            self.truth(n.node, env)
        else:
            self.expr(n, env)

    def structural(self, exprs: Iterable[nodes.Node], env: dict) -> None:
        for x in exprs:
            kind = self.expr(x, env)
            if kind != STRUCT:
                raise _Unproven(f"uses a {kind} as a value")

    def compare(self, n: nodes.Compare, env: dict) -> str:
        left = self.expr(n.expr, env)
        rights = [self.expr(op.expr, env) for op in n.ops]
        if left == STRUCT and all(k == STRUCT for k in rights):
            return STRUCT
        membership = len(n.ops) == 1 and n.ops[0].op in ("in", "notin") and rights[0] in (MESSAGE, PART)
        if left == STRUCT and membership:  # a key of a message or part: the same keys in both renderings
            return STRUCT
        raise _Unproven("compares message text")

    def test(self, n: nodes.Test, env: dict) -> str:
        kind = self.expr(n.node, env)
        self.structural([*n.args, *(k.value for k in n.kwargs)], env)
        if n.dyn_args is not None or n.dyn_kwargs is not None:
            self.structural([x for x in (n.dyn_args, n.dyn_kwargs) if x is not None], env)
        if kind != STRUCT and n.name not in _TYPE_TESTS:
            raise _Unproven(f"tests a {kind} with {n.name}")
        return STRUCT

    def filter(self, n: nodes.Filter, env: dict) -> str:
        if n.node is None:
            raise _Unproven("filter block")
        kind = self.expr(n.node, env)
        self.structural([*n.args, *(k.value for k in n.kwargs),
                         *(x for x in (n.dyn_args, n.dyn_kwargs) if x is not None)], env)
        if kind == STRUCT:
            return STRUCT
        if kind == MESSAGES and n.name in _MESSAGES_FILTERS:
            return _MESSAGES_FILTERS[n.name]
        if kind == TEXT and n.name == "string":
            return TEXT
        raise _Unproven(f"filters a {kind} with {n.name}")

    def item(self, n: nodes.Getattr | nodes.Getitem, env: dict) -> str:
        key: object
        if isinstance(n.node, nodes.Name) and env.get(n.node.name) == NAMESPACE:
            attr = _path(n)
            if attr is None:
                raise _Unproven(f"computed attribute of the namespace {n.node.name}")
            return env.get(f"{n.node.name}.{attr[1]}", STRUCT)
        obj = self.expr(n.node, env)
        if isinstance(n, nodes.Getattr):
            key = n.attr
        elif isinstance(n.arg, nodes.Const):
            key = n.arg.value
        elif isinstance(n.arg, nodes.Slice):
            self.expr(n.arg, env)
            key = slice(None)
        else:
            self.structural([n.arg], env)
            key = None  # computed
        if obj == STRUCT:
            return STRUCT
        if obj.startswith(LOOP):
            return obj[len(LOOP):] if key in ("previtem", "nextitem") else STRUCT
        if obj == MESSAGES and isinstance(n, nodes.Getitem) and not isinstance(key, str):
            return MESSAGES if isinstance(key, slice) else MESSAGE
        if obj in (MESSAGE, PART) and isinstance(key, str) and key not in _DICT_ATTRIBUTES:
            if obj == MESSAGE and key == "content":
                return CONTENT if self.lists else TEXT
            return TEXT if obj == PART and key == "text" else STRUCT
        raise _Unproven(f"looks into a {obj} with {key!r}")

    def call(self, n: nodes.Call, env: dict) -> str:
        extra = [x for x in (n.dyn_args, n.dyn_kwargs) if x is not None]
        macro = self.macros.get(n.node.name) if isinstance(n.node, nodes.Name) and n.node.name not in env else None
        if macro is None:
            self.structural([n.node, *n.args, *(k.value for k in n.kwargs), *extra], env)
            named = isinstance(n.node, nodes.Name) and n.node.name == "namespace" and n.node.name not in env
            return NAMESPACE if named else STRUCT
        self.structural(extra, env)
        params = [a.name for a in macro.args]
        args = dict(zip(params, (self.expr(a, env) for a in n.args)))
        self.structural(n.args[len(params):], env)  # into varargs
        for k in n.kwargs:
            kind = self.expr(k.value, env)
            if k.key in params:
                args[k.key] = kind
            elif kind != STRUCT:
                raise _Unproven("text passed into a macro's kwargs")
        return self.macro(macro, args, env)

    def macro(self, macro: nodes.Macro, args: dict[str, str], env: dict) -> str:
        """Prove a macro's body for the kinds of its arguments; its value (what it prints) is TEXT when it
        prints text."""
        key = (macro.name, tuple(sorted(args.items())), frozenset((k, v) for k, v in env.items() if isinstance(k, str)))
        if key in self.calls:
            return self.calls[key]
        if key in self.active:
            raise _Unproven("recursive macro")
        self.active.add(key)
        inner = {k: v for k, v in env.items() if isinstance(k, str)}
        defaults = dict(zip([a.name for a in macro.args][len(macro.args) - len(macro.defaults):], macro.defaults))
        for a in macro.args:
            inner[a.name] = args[a.name] if a.name in args else \
                self.expr(defaults[a.name], inner) if a.name in defaults else STRUCT
        for name in ("varargs", "kwargs", "caller"):
            inner[name] = STRUCT
        printed, self.text_output = self.text_output, False
        self.block(macro.body, inner)
        result = TEXT if self.text_output else STRUCT
        self.text_output = printed
        self.merge(env, {k: v for k, v in inner.items() if isinstance(k, str) and "." in k})  # namespaces
        self.active.discard(key)
        self.calls[key] = result
        return result


def _path(n: nodes.Node) -> tuple | None:
    """``x``, ``x.a`` or ``x['a']`` as a tuple of names (what a narrowing is keyed by), else None."""
    if isinstance(n, nodes.Name):
        return (n.name,)
    if isinstance(n, (nodes.Getattr, nodes.Getitem)):
        key = n.attr if isinstance(n, nodes.Getattr) else n.arg.value if isinstance(n.arg, nodes.Const) else None
        base = _path(n.node)
        return base + (key,) if base is not None and isinstance(key, str) else None
    return None


def _stored_names(targets: Iterable[nodes.Node]) -> set[str]:
    return {x.name for t in targets for x in ([t] if isinstance(t, nodes.Name) else t.find_all(nodes.Name))}


def _assigned_names(bodies: Iterable[Any]) -> set[str]:
    """Every name assigned (or bound by a loop) anywhere in these bodies."""
    out: set[str] = set()
    for body in bodies:
        for node in body:
            out |= {x.name for x in node.find_all(nodes.Name) if x.ctx in ("store", "param")}
            if isinstance(node, nodes.Name) and node.ctx in ("store", "param"):
                out.add(node.name)
    return out


@dataclass(frozen=True)
class _Layout:
    """A shape's holed rendering: the text as literal pieces and hole numbers, and for each assistant turn where
    its prefix rendering (with the generation prompt) ends: literal characters plus the lengths of these holes."""

    pieces: tuple[str | int, ...]
    starts: tuple[tuple[int, tuple[int, ...]], ...]


class ShapeRenderer:
    """Renders conversations (as the template wants its messages) through a cache of shapes. ``render(messages,
    add_generation_prompt)`` is the template's own rendering."""

    def __init__(self, tree: nodes.Template, render: Callable[[list[dict], bool], str]):
        self.proven = {lists: copies_text_verbatim(tree, lists) for lists in (False, True)}
        self._render = render
        self._cache: dict[tuple, _Layout | None] = {}

    def render(self, messages: list[dict]) -> tuple[str, dict[int, int]] | None:
        """The rendered text and, for each assistant turn, the length of its prefix rendering (it is a prefix of
        the text); None where the shape cannot be used (the caller renders as usual): the template is not proven
        for it, or its holed renderings fail or do not nest."""
        key: list[tuple] = []
        texts: list[str] = []
        lists = False
        for m in messages:
            content = m["content"]
            if isinstance(content, str):
                key.append((m["role"], bool(content)))
                if content:
                    texts.append(content)
            else:
                lists = True
                parts = tuple((p["type"], bool(p.get("text"))) for p in content)
                key.append((m["role"], parts))
                texts += [p["text"] for p in content if p.get("text")]
        if not self.proven[lists]:
            return None
        shape = tuple(key)
        if shape in self._cache:
            layout = self._cache[shape]
        else:
            if len(self._cache) >= _CACHE_SHAPES:
                self._cache.clear()
            layout = self._cache[shape] = self._layout(messages, len(texts))
        if layout is None:
            return None
        text = "".join([texts[p] if isinstance(p, int) else p for p in layout.pieces])
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return text, {i: fixed + sum(len(texts[h]) for h in holes) for i, (fixed, holes) in zip(turns, layout.starts)}

    def _layout(self, messages: list[dict], n_texts: int) -> _Layout | None:
        """The shape's layout, from holed renderings with placeholders of two private-use planes: both must agree,
        so no placeholder character the template itself prints (whatever its source) is taken for a text."""
        if n_texts > _HOLES:
            return None
        try:
            layouts = {self._holed_layout(messages, n_texts, base) for base in _BASES}
        except Exception:
            return None  # the real rendering raises the template's own error
        return layouts.pop() if len(layouts) == 1 else None

    def _holed_layout(self, messages: list[dict], n_texts: int, base: int) -> _Layout | None:
        holed, hole = [], iter(range(n_texts))
        for m in messages:
            content = m["content"]
            if isinstance(content, str):
                holed.append({**m, "content": chr(base + next(hole)) if content else ""})
            else:
                parts = [{**p, "text": chr(base + next(hole))} if p.get("text") else p for p in content]
                holed.append({**m, "content": parts})
        full = self._render(holed, False)
        starts = []
        for i, m in enumerate(holed):
            if m["role"] == "assistant":
                prefix = self._render(holed[:i], True)
                if not full.startswith(prefix):
                    return None  # the prefix renderings decide (and name the failure)
                holes = tuple(ord(c) - base for c in prefix if base <= ord(c) < base + n_texts)
                starts.append((len(prefix) - len(holes), holes))
        split = re.split(f"([{chr(base)}-{chr(base + n_texts - 1)}])", full) if n_texts else [full]
        pieces = (ord(p) - base if i % 2 else p for i, p in enumerate(split))
        return _Layout(tuple(p for p in pieces if p != ""), tuple(starts))
