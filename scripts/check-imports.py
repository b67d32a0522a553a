#!/usr/bin/env python3
"""No import circle in src/: neither between files nor between folders.

Reads every file of src/ but the simulated node (src/standin/) and the binaries (src/bin/),
leaves out comments and test modules, and takes each path a file names: `use` statements
(`pub use` re-exports too) and `crate::`, `super::`, `self::` and child-module paths in its
code. A name a module re-exports is followed to the file that defines it. A circle is a
strongly connected set of files (a folder's mod.rs counts as a file: a child that uses what
mod.rs defines while mod.rs uses the child is a circle), or two top-level folders that import
each other. Prints each circle with the paths that make it and exits 1; else says so, exit 0.

Usage: scripts/check-imports.py
"""
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def code_of(text):
    """The file without comments and without its test modules."""
    lines = [l for l in text.split("\n") if not l.strip().startswith("//")]
    return re.sub(r"#\[cfg\(test\)\]\s*mod \w+ \{.*", "", "\n".join(lines), flags=re.S)


def use_tree(prefix, body):
    """The paths of a `use` tree's braces."""
    items, depth, item = [], 0, ""
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    paths = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        nested = re.match(r"((?:\w+::)*)\{(.*)\}$", item, re.S)
        if nested:
            head = [s for s in nested.group(1).split("::") if s]
            paths += use_tree(prefix + head, nested.group(2))
        else:
            paths.append(prefix + item.split(" as ")[0].strip().split("::"))
    return paths


def uses(code):
    """(is a re-export, path) for every path a `use` names."""
    found = []
    for m in re.finditer(r"\b(pub(?:\(\w+\))?\s+)?use\s+([^;]*);", code, re.S):
        tree = m.group(2).strip()
        nested = re.match(r"((?:\w+::)*)\{(.*)\}$", tree, re.S)
        if nested:
            paths = use_tree([s for s in nested.group(1).split("::") if s], nested.group(2))
        else:
            paths = [tree.split(" as ")[0].split("::")]
        found += [(bool(m.group(1)), p) for p in paths]
    return found


def main():
    files = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".rs") and os.sep + "bin" + os.sep not in path:
                files[module_of(path)] = code_of(open(path).read())
    skipped = lambda m: (m and m[0] == "standin") or (m and m[-1] == "tests")

    def absolute(me, segs):
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] == "super":
            base, segs = list(me[:-1]), segs[1:]
            while segs and segs[0] == "super":
                base, segs = base[:-1], segs[1:]
            return base + segs
        if segs[0] == "self":
            return list(me) + segs[1:]
        if tuple(list(me) + segs[:1]) in files:
            return list(me) + segs
        return None

    reexports = collections.defaultdict(dict)
    for me, code in files.items():
        for public, segs in uses(code):
            path = absolute(me, segs) if public else None
            if path:
                reexports[me][segs[-1]] = path

    def defined_in(path, hops=0):
        for k in range(len(path), 0, -1):
            module = tuple(path[:k])
            if module in files:
                rest = path[k:]
                if rest and rest[0] in reexports[module] and hops < 8:
                    return defined_in(reexports[module][rest[0]] + rest[1:], hops + 1)
                return module
        return None

    edges = collections.defaultdict(set)
    why = collections.defaultdict(set)
    for me, code in files.items():
        if skipped(me):
            continue
        paths = [segs for _, segs in uses(code)]
        paths += [[m.group(1)] + m.group(2).split("::")
                  for m in re.finditer(r"\b(crate|super)::((?:\w+::)*\w+)", code)]
        paths += [["self", m.group(1)] + m.group(2).split("::")
                  for m in re.finditer(r"(?<![:\w])(\w+)::((?:\w+::)*\w+)", code)
                  if tuple(list(me) + [m.group(1)]) in files]
        for segs in paths:
            path = absolute(me, segs)
            target = defined_in(path) if path else None
            if target and target != me and target != () and not skipped(target):
                edges[me].add(target)
                why[(me, target)].add("::".join(segs))

    circles = strongly_connected(edges)
    name = lambda m: "::".join(m) or "crate"
    for circle in circles:
        print("circle:", ", ".join(sorted(name(m) for m in circle)))
        for a in circle:
            for b in sorted(edges[a] & set(circle)):
                print(f"  {name(a)} -> {name(b)}: {', '.join(sorted(why[(a, b)])[:4])}")
    folders = collections.defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if a and b and a[0] != b[0]:
                folders[a[0]].add(b[0])
    pairs = sorted((a, b) for a in folders for b in folders[a] if a < b and a in folders.get(b, ()))
    for a, b in pairs:
        print(f"circle: folders {a}/ and {b}/ import each other")
    if circles or pairs:
        return 1
    checked = sum(1 for m in files if not skipped(m))
    print(f"check-imports: no import circle among {checked} files of src/ "
          "(the simulated node, the binaries and test modules left out)")
    return 0


def strongly_connected(edges):
    """Tarjan's algorithm; the sets of more than one file."""
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    sys.exit(main())
