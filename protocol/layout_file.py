"""Layout plan files: the plan of any model the built-in plans do not know, as a small JSON document.

The daemon reads the file (bounded) and hands its bytes here; parsing checks every field and refuses
with one line; ``PlanFile.expand`` applies the rules to a checkpoint's tensors for a number of ranks and
returns a checked ``LayoutPlan``.  The format (docs/models.md, "Layout plans", has an example)::

    {"format": "patchswarm-layout-plan", "version": 1,
     "expert_parallel": false,                       # optional, the caller may override it
     "rules": [{"match": PATTERN, "rule": KIND, ...}, ...]}

A PATTERN is a canonical tensor name where ``{X}`` (X: capital letters) stands for a decimal index (a
layer, an expert); templates in ``as`` / ``into`` / ``order`` reuse the captured indexes.  The first
rule that matches a tensor applies.  KIND is one of:

- ``replicate`` (``as``: runtime name, default the same): whole on every rank.
- ``split`` (``dim``; ``as``): cut in equal parts along ``dim``, part r on rank r.
- ``vocab`` (``pad``: default 64; ``as``): rows padded with zeros to a multiple of ``pad``, then split.
- ``fuse`` (``into``, ``dim``, ``order``: the source templates in runtime order; ``split``: default true;
  ``heads``: optional head count per source, a source with fewer heads than ranks is replicated, rank r
  taking head r // (ranks / heads)): each source's part of rank r, one after another along ``dim``; a
  0-d source (a per-tensor scale) takes element k of a vector with one element per source.
- ``experts`` (``into``, ``expert``: the placeholder of the expert index, ``experts``: the count,
  ``dim``, ``part``, ``parts``): expert e's tensor goes to ``into[e_local]``, its ``dim`` holding ``parts``
  slots of which this tensor fills slot ``part`` (gate 0 / up 1 of 2 for w13; 0 of 1 for w2).  Tensor
  parallel: every rank holds every expert, cut along ``dim``; expert parallel: rank r holds experts
  [r*E/N, (r+1)*E/N) whole.
- ``ignore``: the engine does not load it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.layout_plan import MAX_DIMS, Box, LayoutPlan, PlanBuilder, full_box
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

FORMAT = "patchswarm-layout-plan"
VERSION = 1
MAX_FILE_BYTES = 1 << 20
MAX_RULES = 512
MAX_PATTERN = 512
MAX_ORDER = 16
MAX_PLACEHOLDERS = 4
MAX_EXPERTS = 1 << 16
MAX_PIECES = 1 << 22
KINDS = ("replicate", "split", "vocab", "fuse", "experts", "ignore")
_FIELDS = {
    "replicate": {"as"},
    "split": {"dim", "as"},
    "vocab": {"pad", "as"},
    "fuse": {"into", "dim", "order", "split", "heads"},
    "experts": {"into", "expert", "experts", "dim", "part", "parts"},
    "ignore": set(),
}
_PLACEHOLDER = re.compile(r"\{([A-Z]{1,8})\}")
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.{}\-]+$")


@dataclass(frozen=True, slots=True)
class Rule:
    match: str
    kind: str
    regex: re.Pattern[str]
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PlanFile:
    rules: tuple[Rule, ...]
    expert_parallel: bool = False

    def expand(
        self, canonical_specs: Sequence[TensorSpec], world: int, *, expert_parallel: bool | None = None
    ) -> LayoutPlan:
        """The plan these rules give for ``canonical_specs`` on ``world`` ranks, checked."""
        ep = self.expert_parallel if expert_parallel is None else expert_parallel
        b = PlanBuilder(world, "plan file" + (" (expert parallel)" if ep else ""), max_pieces=MAX_PIECES)
        by_name = {s.name: s for s in canonical_specs}
        for spec in canonical_specs:
            for rule in self.rules:
                m = rule.regex.match(spec.name)
                if m is not None:
                    _apply(b, rule, spec, m.groupdict(), by_name, world, ep)
                    break
        plan = b.build()
        plan.check(canonical_specs)
        return plan


def _fail(msg: str) -> PlanError:
    return PlanError(f"plan file: {msg}")


def parse_plan_file(data: bytes | str) -> PlanFile:
    """Parse and validate a plan file's bytes (bounded; one line on any fault)."""
    if len(data) > MAX_FILE_BYTES:
        raise _fail(f"larger than {MAX_FILE_BYTES} bytes")
    try:  # strict: a key given twice (two "rules") is refused, not resolved by whichever came last
        doc = load_json(data, max_bytes=MAX_FILE_BYTES)
    except UntrustedJSONError as e:
        raise _fail(str(e)) from None
    if not isinstance(doc, dict):
        raise _fail("the document must be a JSON object")
    unknown = set(doc) - {"format", "version", "expert_parallel", "rules"}
    if unknown:
        raise _fail(f"unknown field {_short(sorted(unknown)[0])}")
    if doc.get("format") != FORMAT:
        raise _fail(f"format must be {FORMAT!r}")
    if doc.get("version") != VERSION or type(doc.get("version")) is not int:
        raise _fail(f"version {_short(doc.get('version'))} (this build reads {VERSION})")
    ep = doc.get("expert_parallel", False)
    if not isinstance(ep, bool):
        raise _fail("expert_parallel must be true or false")
    rules = doc.get("rules")
    if not isinstance(rules, list) or not rules:
        raise _fail("rules must be a non-empty list")
    if len(rules) > MAX_RULES:
        raise _fail(f"more than {MAX_RULES} rules")
    return PlanFile(tuple(_rule(r, f"rules[{i}]") for i, r in enumerate(rules)), ep)


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def _rule(r: Any, where: str) -> Rule:
    if not isinstance(r, dict):
        raise _fail(f"{where} must be an object")
    kind = r.get("rule")
    if kind not in KINDS:
        raise _fail(f"{where}.rule must be one of {', '.join(KINDS)}")
    extra = set(r) - {"match", "rule"} - _FIELDS[kind]
    if extra:
        raise _fail(f"{where}: field {_short(sorted(extra)[0])} does not belong to a {kind} rule")
    match = _template(r.get("match"), f"{where}.match")
    names = _PLACEHOLDER.findall(match)
    if len(names) != len(set(names)):
        raise _fail(f"{where}.match uses a placeholder twice")
    captured = set(names)
    p: dict[str, Any] = {}
    if "as" in r:
        p["as"] = _template(r["as"], f"{where}.as", captured)
    if kind in ("split", "fuse", "experts"):
        p["dim"] = _int(r.get("dim"), f"{where}.dim", 0, MAX_DIMS - 1)
    if kind == "vocab":
        p["pad"] = _int(r.get("pad", 64), f"{where}.pad", 1, 1 << 20)
    if kind in ("fuse", "experts"):
        p["into"] = _template(r.get("into"), f"{where}.into", captured)
    if kind == "fuse":
        order = r.get("order")
        if not isinstance(order, list) or not 1 <= len(order) <= MAX_ORDER:
            raise _fail(f"{where}.order must be a list of 1 to {MAX_ORDER} names")
        p["order"] = [_template(o, f"{where}.order[{k}]", captured) for k, o in enumerate(order)]
        split = r.get("split", True)
        if not isinstance(split, bool):
            raise _fail(f"{where}.split must be true or false")
        p["split"] = split
        heads = r.get("heads")
        if heads is not None:
            if not isinstance(heads, list) or len(heads) != len(order):
                raise _fail(f"{where}.heads must list one head count per source in order")
            p["heads"] = [_int(h, f"{where}.heads[{k}]", 1, 1 << 20) for k, h in enumerate(heads)]
    if kind == "experts":
        expert = r.get("expert")
        if not isinstance(expert, str) or expert not in captured:
            raise _fail(f"{where}.expert must name a placeholder of match")
        p["expert"] = expert
        p["experts"] = _int(r.get("experts"), f"{where}.experts", 1, MAX_EXPERTS)
        p["parts"] = _int(r.get("parts", 1), f"{where}.parts", 1, 16)
        p["part"] = _int(r.get("part", 0), f"{where}.part", 0, p["parts"] - 1)
        if "{" + expert + "}" in p["into"]:
            raise _fail(f"{where}.into must not use the expert placeholder (experts share one parameter)")
    regex = re.compile(
        "^"
        + "".join(
            f"(?P<{part}>[0-9]{{1,6}})" if k % 2 else re.escape(part)
            for k, part in enumerate(_PLACEHOLDER.split(match))
        )
        + "$"
    )
    return Rule(match, kind, regex, p)


def _template(x: Any, where: str, captured: set[str] | None = None) -> str:
    if not isinstance(x, str) or not 1 <= len(x) <= MAX_PATTERN or not _NAME_CHARS.match(x):
        raise _fail(f"{where} must be a tensor name of 1 to {MAX_PATTERN} characters [A-Za-z0-9_.-] and {{X}}")
    names = _PLACEHOLDER.findall(x)
    if len(names) > MAX_PLACEHOLDERS or x.count("{") != len(names) or x.count("}") != len(names):
        raise _fail(f"{where}: placeholders are {{X}} with X capital letters, at most {MAX_PLACEHOLDERS}")
    if captured is not None:
        missing = [n for n in names if n not in captured]
        if missing:
            raise _fail(f"{where} uses {{{missing[0]}}}, which match does not capture")
    return x


def _int(x: Any, where: str, lo: int, hi: int) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise _fail(f"{where} must be an integer {lo}..{hi}")
    return x


def _fill(template: str, caps: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: caps[m.group(1)], template)


def _even(n: int, world: int, what: str) -> int:
    if n % world:
        raise PlanError(f"layout plan: {what} ({n}) does not divide by {world}")
    return n // world


def _along(shape: Sequence[int], dim: int, span: tuple[int, int]) -> Box:
    box = list(full_box(shape))
    box[dim] = span
    return tuple(box)


def _dim_of(spec: TensorSpec, dim: int, where: str) -> None:
    if dim >= len(spec.shape):
        raise PlanError(f"layout plan: {where}: {spec.name} has {len(spec.shape)} dims, no dim {dim}")


def _apply(
    b: PlanBuilder,
    rule: Rule,
    spec: TensorSpec,
    caps: dict[str, str],
    by_name: dict[str, TensorSpec],
    world: int,
    ep: bool,
) -> None:
    p = rule.params
    name = spec.name
    shape = spec.shape
    kind = rule.kind
    if kind == "ignore":
        b.ignore(name)
    elif kind == "replicate":
        out = _fill(p["as"], caps) if "as" in p else name
        for r in range(world):
            b.param(r, out, shape, spec.dtype)
            b.place(name, r, out, full_box(shape), full_box(shape))
    elif kind in ("split", "vocab"):
        out = _fill(p["as"], caps) if "as" in p else name
        dim = p.get("dim", 0)
        _dim_of(spec, dim, rule.match)
        size = shape[dim]
        total = -(-size // p["pad"]) * p["pad"] if kind == "vocab" else size
        n = _even(total, world, f"{name} dim {dim}")
        local = tuple(n if k == dim else s for k, s in enumerate(shape))
        for r in range(world):
            b.param(r, out, local, spec.dtype, padded=kind == "vocab")
            a, z = r * n, min((r + 1) * n, size)
            if a < z:
                b.place(name, r, out, _along(shape, dim, (a, z)), _along(local, dim, (0, z - a)))
    elif kind == "fuse":
        _fuse(b, rule, spec, caps, by_name, world)
    else:
        _expert(b, rule, spec, caps, world, ep)


def _fuse(
    b: PlanBuilder, rule: Rule, spec: TensorSpec, caps: dict[str, str], by_name: dict[str, TensorSpec], world: int
) -> None:
    p = rule.params
    into = _fill(p["into"], caps)
    order = [_fill(o, caps) for o in p["order"]]
    if spec.name not in order:
        raise PlanError(f"layout plan: fuse into {into}: {spec.name} is not in its order list")
    k = order.index(spec.name)
    if not spec.shape:  # per-tensor scales: one element per source
        for r in range(world):
            b.param(r, into, (len(order),), spec.dtype)
            b.place(spec.name, r, into, (), ((k, k + 1),))
        return
    dim = p["dim"]
    sources = []
    for o in order:
        s = by_name.get(o)
        if s is None:
            raise PlanError(f"layout plan: fuse into {into}: source {o} is not in the checkpoint")
        _dim_of(s, dim, rule.match)
        sources.append(s)
    heads = p.get("heads")
    for r in range(world):
        spans = []
        for j, s in enumerate(sources):
            rows = s.shape[dim]
            if not p["split"] or world == 1:
                spans.append((0, rows))
            elif heads is not None and heads[j] < world:
                h = heads[j]
                if world % h or rows % h:
                    raise PlanError(f"layout plan: {s.name}: {h} heads replicate over {world} ranks only if it divides")
                per = rows // h
                head = r // (world // h)
                spans.append((head * per, (head + 1) * per))
            else:
                if heads is not None:
                    _even(heads[j], world, f"{s.name} heads")
                n = _even(rows, world, f"{s.name} dim {dim}")
                spans.append((r * n, (r + 1) * n))
        sizes = [z - a for a, z in spans]
        local = tuple(sum(sizes) if d == dim else n for d, n in enumerate(spec.shape))
        off = sum(sizes[:k])
        b.param(r, into, local, spec.dtype)
        b.place(spec.name, r, into, _along(spec.shape, dim, spans[k]), _along(local, dim, (off, off + sizes[k])))


def _expert(b: PlanBuilder, rule: Rule, spec: TensorSpec, caps: dict[str, str], world: int, ep: bool) -> None:
    p = rule.params
    into = _fill(p["into"], caps)
    e = int(caps[p["expert"]])
    count = p["experts"]
    if e >= count:
        raise PlanError(f"layout plan: {spec.name}: expert {e} of a layer with {count} experts")
    dim = p["dim"]
    _dim_of(spec, dim, rule.match)
    shape = spec.shape
    if ep:
        local_e = _even(count, world, f"{into}: experts over expert-parallel ranks")
        ranks, n = [e // local_e], shape[dim]
    else:
        local_e = count
        ranks, n = list(range(world)), _even(shape[dim], world, f"{spec.name} dim {dim}")
    slot = tuple(n * p["parts"] if d == dim else s for d, s in enumerate(shape))
    for r in ranks:
        part = 0 if ep else r
        le = e % local_e
        b.param(r, into, (local_e, *slot), spec.dtype)
        src = _along(shape, dim, (part * n, (part + 1) * n))
        dst = ((le, le + 1), *_along(slot, dim, (p["part"] * n, (p["part"] + 1) * n)))
        b.place(spec.name, r, into, src, dst)
