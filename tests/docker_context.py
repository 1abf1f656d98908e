"""What `docker build` sends as its context: the files a `.dockerignore` keeps, matched as Docker matches them.

Why: an image recipe whose `COPY` names a file the ignore file drops fails only at build time, on the
user's machine (`COPY failed: ... not found`). No library in the lock implements Docker's rules (pathspec
does gitignore's, which differ: a pattern without a slash matches at any depth there, at the root only
here), so this follows moby's `patternmatcher` (what `docker build` and BuildKit use), from its source:

- each line is a pattern; `#` lines and blank ones are skipped; surrounding whitespace is trimmed;
  a leading `!` makes it an exception; patterns are cleaned like Go's `filepath.Clean`, a leading `/`
  dropped;
- Go's `filepath.Match` syntax: `*` any run of non-separators, `?` one non-separator, `[...]` a class
  (`[^...]`/`[!...]` negated, `a-z` ranges), `\\` escapes; plus `**`, any number of directories;
- a path is excluded when the last pattern that matches it, or any of its parent directories, is not
  an exception (`MatchesOrParentMatches`);
- a Dockerfile-specific ignore file (`<Dockerfile>.dockerignore` next to it, BuildKit) replaces the root's.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool
    regex: re.Pattern[str]


def _regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match on '/'-separated paths, with moby's `**` (as patternmatcher.compile does)."""
    out, i, n = ["^"], 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 1  # `**`: any number of directories (`**/` as `**`); at the end, anything
                if i + 1 < n and pattern[i + 1] == "/":
                    i += 1
                out.append("(.*/)?" if i + 1 < n else ".*")
            else:
                out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = pattern.find("]", i + 2 if i + 1 < n and pattern[i + 1] in "^!" else i + 1)
            if end < 0:
                raise ValueError(f"bad pattern {pattern!r}: unclosed '['")
            body = pattern[i + 1:end]
            negate = body[:1] in ("^", "!")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end
        elif ch == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    return re.compile("".join(out))


def parse(text: str) -> list[Pattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        cleaned = posixpath.normpath(line)
        cleaned = cleaned.lstrip("/") or "."
        patterns.append(Pattern(line, exclusion, _regex(cleaned)))
    return patterns


def excluded(path: str, patterns: list[Pattern]) -> bool:
    """Whether `path` (relative, '/'-separated) is left out of the context."""
    parts = path.split("/")
    candidates = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    matched = False
    for pattern in patterns:
        if any(pattern.regex.match(c) for c in candidates):
            matched = not pattern.exclusion
    return matched


def ignore_file(root: Path, dockerfile: Path) -> Path | None:
    """The ignore file `docker build -f dockerfile root` uses (BuildKit's Dockerfile-specific one first)."""
    specific = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if specific.is_file():
        return specific
    return root / ".dockerignore" if (root / ".dockerignore").is_file() else None


def context_files(root: Path, dockerfile: Path) -> set[str]:
    """Every file of the context `docker build -f dockerfile root` sends, relative and '/'-separated."""
    chosen = ignore_file(root, dockerfile)
    patterns = parse(chosen.read_text()) if chosen else []
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and not excluded(p.relative_to(root).as_posix(), patterns)}


def copy_sources(dockerfile: Path) -> list[str]:
    """The context paths every COPY/ADD names (not `--from=` stages, not URLs), ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    sources = []
    for match in re.finditer(r"^(COPY|ADD)\s+(.*)$", text, re.M):
        words = match[2].split()
        if words and words[0].startswith("["):  # the JSON form
            import json

            words = json.loads(match[2])
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [w for w in words if not w.startswith("--")][:-1]  # the last one is the destination
        for path in paths:
            if re.match(r"^(https?|git)://", path) or path.startswith("git@"):
                continue
            sources.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), path))
    return sources


def source_found(source: str, files: set[str]) -> bool:
    """Whether COPY's `source` (a path, a directory or a filepath.Match glob) names something in the context."""
    cleaned = posixpath.normpath(source).lstrip("/")
    if cleaned == ".":
        return bool(files)
    regex = _regex(cleaned)
    return any(regex.match(f) or f.startswith(cleaned + "/") or
               any(regex.match("/".join(f.split("/")[:k])) for k in range(1, f.count("/") + 1)) for f in files)
