"""Complete conversations written by humans, for capture without regeneration.

Prefill-only capture (answers given, no generation) costs a forward pass per token, far
less than regenerating answers with the target first. With no internet here, the text comes
from the Python installation itself:
- `pydoc`: the language reference topics in `pydoc_data.topics` (user: a question about the
  topic; assistant: the topic text, cleaned and chunked at paragraph boundaries);
- `stdlib`: functions with docstrings in a fixed list of pure-Python stdlib modules (user:
  "Write a Python function `f(sig)` that ..."; assistant: one prose line + the source).

Items sharing a word 8-gram with MT-bench or HumanEval are dropped (eval hygiene), and so are
functions named like a HumanEval function. `mix` combines a target regeneration with prefill
items into one prompt set (`turns`+`answers` records, which `data.load_prompt_set` reads).

    python -m workbench.corpus build --out F.jsonl [--max-items N] [--max-tokens 384]
    python -m workbench.corpus mix --regen DIR --prefill F --out G --fraction 0.5
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.data import DataError, Prompt, load_humaneval, load_mtbench, load_prompt_set
from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_text
from workbench.selfprompts import ngrams as word_ngrams
from workbench.selfprompts import words

NGRAM = 8
SOURCES = ("pydoc", "stdlib")
# Pure-Python stdlib modules read with `ast` (never imported); fixed order = fixed output.
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "doctest", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
    "genericpath", "getopt", "gettext", "glob", "heapq", "html", "http.client",
    "http.cookiejar", "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder",
    "keyword", "linecache", "locale", "logging", "mimetypes", "ntpath", "operator", "optparse",
    "os", "pathlib", "pickle", "platform", "posixpath", "pprint", "pstats", "pydoc", "queue",
    "quopri", "random", "reprlib", "sched", "selectors", "shlex", "shutil", "smtplib",
    "statistics", "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing",
    "unittest.case", "urllib.parse", "urllib.request", "warnings", "wave", "weakref",
    "xml.dom.minidom", "zipfile",
)  # fmt: skip
QUESTIONS = (
    "Explain {topic} in Python.",
    "How does {topic} work in Python?",
    "Can you describe {topic} in Python?",
    "What should I know about {topic} in Python?",
)
CountTokens = Callable[[str], int]


class CorpusError(WorkbenchError):
    """A corpus could not be built or mixed from the given inputs."""


@dataclass
class CorpusReport:
    """What a build kept and dropped, per source."""

    items: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # assistant tokens kept
    dropped_overlap: dict[str, int] = field(default_factory=dict)
    dropped_too_long: dict[str, int] = field(default_factory=dict)
    skipped_humaneval_names: int = 0

    def summary(self) -> str:
        rows = [
            f"  {s}: {self.items.get(s, 0)} items, {self.tokens.get(s, 0)} assistant tokens, "
            f"dropped {self.dropped_overlap.get(s, 0)} for eval 8-gram overlap, "
            f"{self.dropped_too_long.get(s, 0)} over the token limit"
            for s in SOURCES
        ]
        tail = f"  stdlib functions skipped for a HumanEval name: {self.skipped_humaneval_names}"
        return "\n".join([*rows, tail])


# ---------------------------------------------------------------- eval hygiene


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Word n-grams of a text (the words of `selfprompts.words`: one overlap unit for both)."""
    return word_ngrams(words(text), n)


def eval_ngrams() -> set[tuple[str, ...]]:
    """Word 8-grams of every MT-bench turn (both) and every HumanEval prompt."""
    out: set[tuple[str, ...]] = set()
    for p in load_mtbench() + load_humaneval():
        for t in p.turns:
            out |= ngrams(t)
    return out


def humaneval_names() -> set[str]:
    """Names of the functions HumanEval prompts define (entry points and their helpers)."""
    return {m for p in load_humaneval() for m in re.findall(r"def\s+(\w+)\s*\(", p.turns[0])}


def overlaps(p: Prompt, banned: set[tuple[str, ...]]) -> bool:
    return any(ngrams(t) & banned for t in [*p.turns, *p.answers])


# ---------------------------------------------------------------- source (a): pydoc topics

_UNDERLINE = re.compile(r"^\s*([*=\-~^#\"'`+])\1{2,}\s*$")
_FOOTNOTE_REF = re.compile(r"\s?\[\d+\]")


def clean_topic(text: str) -> list[tuple[str, str]]:
    """(heading, paragraph) pairs of a topic: underlines, footnotes and hard wraps removed.

    pydoc's topics are already rendered from reST; what is left is noise a reader would not
    write: `****` underlines under headings, `[1]` references and the footnotes section."""
    text = text.split("-[ Footnotes ]-")[0]
    lines = text.splitlines()
    out: list[tuple[str, str]] = []
    heading, para = "", []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if _UNDERLINE.match(line):
            continue
        if line.strip() and _UNDERLINE.match(nxt):  # a heading
            if para:
                out.append((heading, "\n".join(para).strip("\n")))
                para = []
            heading = line.strip()
            continue
        if not line.strip():
            if para:
                out.append((heading, "\n".join(para).strip("\n")))
                para = []
            continue
        para.append(_FOOTNOTE_REF.sub("", line.rstrip()))
    if para:
        out.append((heading, "\n".join(para).strip("\n")))
    return [(h, _unwrap(p)) for h, p in out if p.strip()]


def _unwrap(par: str) -> str:
    """Prose hard-wrapped at 72 columns becomes one line; indented code keeps its lines."""
    lines = par.splitlines()
    return par if any(line[:1].isspace() for line in lines) else " ".join(lines)


def _pack(units: list[str], sep: str, max_tokens: int, count: CountTokens) -> list[str]:
    """Greedy packing of units into pieces of <= max_tokens (a lone unit may exceed it)."""
    pieces, cur = [], ""
    for u in units:
        cand = f"{cur}{sep}{u}" if cur else u
        if cur and count(cand) > max_tokens:
            pieces.append(cur)
            cand = u
        cur = cand
    return [*pieces, cur] if cur else pieces


def _split_long(par: str, max_tokens: int, count: CountTokens) -> list[str]:
    """A paragraph over the limit, split at line ends, and a line over it at spaces."""
    lines = []
    for line in par.splitlines():
        lines += (
            [line] if count(line) <= max_tokens else _pack(line.split(" "), " ", max_tokens, count)
        )
    return _pack(lines, "\n", max_tokens, count)


def chunk_topic(text: str, max_tokens: int, count: CountTokens) -> list[tuple[str, str]]:
    """(heading of the chunk's first paragraph, chunk text) with each chunk <= max_tokens."""
    chunks: list[tuple[str, str]] = []
    head, cur = "", ""
    for h, par in clean_topic(text):
        for piece in [par] if count(par) <= max_tokens else _split_long(par, max_tokens, count):
            cand = f"{cur}\n\n{piece}" if cur else piece
            if cur and (h != head or count(cand) > max_tokens):  # a new section starts a chunk
                chunks.append((head, cur))
                cand = piece
            if not cur or cand == piece:
                head = h
            cur = cand
    if cur:
        chunks.append((head, cur))
    return [(h, _flush_left(c)) for h, c in chunks]


def _flush_left(chunk: str) -> str:
    """A chunk opening with an indented block, dedented: the chat template's `assistant\\n`
    would merge with leading spaces into one token, and the loss mask must split there."""
    first, sep, rest = chunk.partition("\n\n")
    return (textwrap.dedent(first) + sep + rest).strip()


def _topic_name(heading: str) -> str:
    name = heading.strip().rstrip(".:")
    return name[0].lower() + name[1:] if name[:1].isupper() and name[1:2].islower() else name


def topic_items(
    key: str, text: str, max_tokens: int, count: CountTokens, seed: int
) -> list[Prompt]:
    """One topic's chunks as conversations; the question wording is seeded per item."""
    out = []
    for j, (heading, body) in enumerate(chunk_topic(text, max_tokens, count)):
        pid = f"pydoc-{key}-{j}"
        q = (
            random.Random(f"{seed}:{pid}")
            .choice(QUESTIONS)
            .format(topic=_topic_name(heading or key))
        )
        out.append(Prompt(id=pid, category="python-docs", turns=[q], answers=[body]))
    return out


# ---------------------------------------------------------------- source (b): stdlib functions

_VERB_SKIP = {"a", "an", "the", "this", "if", "given", "same", "like", "internal", "helper"}


def _that_clause(sentence: str) -> str | None:
    """'Return the x.' -> 'returns the x'; None when the sentence is not an imperative verb."""
    first, _, rest = sentence.partition(" ")
    if not first.isalpha() or not first[0].isupper() or first.lower() in _VERB_SKIP:
        return None
    w = first.lower()
    if w.endswith("s"):
        return None  # already 'Returns ...' or a noun phrase: not an imperative
    if w.endswith(("sh", "ch", "x", "z", "o")):
        w += "es"
    elif w.endswith("y") and w[-2:-1] not in "aeiou":
        w = w[:-1] + "ies"
    else:
        w += "s"
    return f"{w} {rest}".rstrip(" .")


def first_sentence(doc: str) -> str:
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).strip()


def module_file(name: str) -> Path:
    """The .py file of a stdlib module, found without importing it (frozen ones included)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = name.replace(".", "/")
    for p in (root / f"{rel}.py", root / rel / "__init__.py"):
        if p.is_file():
            return p
    raise CorpusError(f"stdlib module {name!r} has no source under {root}")


def _functions(tree: ast.Module) -> Iterator[tuple[str | None, ast.FunctionDef]]:
    """Top-level functions and methods of top-level classes, in source order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    yield node.name, sub


@dataclass
class FunctionUnit:
    """A stdlib function found by `ast`, not yet tokenized."""

    module: str
    cls: str | None
    node: ast.FunctionDef
    source: str  # the module's source text

    @property
    def name(self) -> str:
        return f"{self.cls}.{self.node.name}" if self.cls else self.node.name


def stdlib_functions(skip_names: set[str], report: CorpusReport) -> list[FunctionUnit]:
    """Documented functions and methods of STDLIB_MODULES, in module and source order."""
    out = []
    for mod in STDLIB_MODULES:
        src = module_file(mod).read_text(encoding="utf-8")
        for cls, fn in _functions(ast.parse(src)):
            if not ast.get_docstring(fn) or fn.name.startswith("__"):
                continue
            if fn.name in skip_names:
                report.skipped_humaneval_names += 1
                continue
            out.append(FunctionUnit(mod, cls, fn, src))
    return out


def function_item(u: FunctionUnit) -> Prompt:
    code = textwrap.dedent(ast.get_source_segment(u.source, u.node, padded=True) or "")
    kind = "method" if u.cls else "function"
    sentence = first_sentence(ast.get_docstring(u.node) or "")
    clause = _that_clause(sentence)
    ask = f"Write a Python {kind} `{u.name}({ast.unparse(u.node.args)})`"
    ask = f"{ask} that {clause}." if clause else f"{ask}. {sentence}"
    answer = f"Here is `{u.name}` as the `{u.module}` module defines it:\n\n```python\n{code}\n```"
    return Prompt(id=f"stdlib-{u.module}-{u.name}", category="python-code", turns=[ask],
                  answers=[answer])  # fmt: skip


# ---------------------------------------------------------------- build


def tokenizer_counter(tokenizer) -> CountTokens:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(target: str = "smollm2-135m"):
    """The target's tokenizer only (no weights loaded)."""
    from transformers import AutoTokenizer

    from workbench.target import resolve_target_dir

    return AutoTokenizer.from_pretrained(str(resolve_target_dir(target)[1]))


def build(
    tokenizer,
    max_items: int | None = None,
    max_tokens: int = 384,
    seed: int = 0,
    banned: set[tuple[str, ...]] | None = None,
    skip_names: set[str] | None = None,
) -> tuple[list[Prompt], CorpusReport]:
    """All items of both sources, eval-filtered, shuffled with `seed`, capped at `max_items`.

    `max_tokens` bounds each assistant answer (the chat template and question add ~20-60).
    `banned`/`skip_names` default to the MT-bench/HumanEval 8-grams and HumanEval names."""
    if max_tokens < 16:
        raise CorpusError(f"--max-tokens {max_tokens}: too small for a paragraph; use >= 16")
    if max_items is not None and max_items < 1:
        raise CorpusError(f"--max-items {max_items}: must be at least 1 (omit it for all)")
    from pydoc_data.topics import topics

    count = tokenizer_counter(tokenizer)
    banned = eval_ngrams() if banned is None else banned
    skip_names = humaneval_names() if skip_names is None else skip_names
    report = CorpusReport()
    # Cheap units (topics, functions) in a seeded order, tokenized only until the cap is met:
    # a small --max-items builds in seconds, and is a prefix of the same seed's bigger build.
    units: list[tuple[str, str | FunctionUnit]] = [("pydoc", k) for k in sorted(topics)]
    units += [("stdlib", u) for u in stdlib_functions(skip_names, report)]
    rng = random.Random(seed)
    rng.shuffle(units)
    kept: list[tuple[str, Prompt]] = []
    for source, unit in units:
        if max_items and len(kept) >= max_items:
            break
        if isinstance(unit, FunctionUnit):
            items = [function_item(unit)]
            if count(items[0].answers[0]) > max_tokens:  # code is not chunked
                report.dropped_too_long[source] = report.dropped_too_long.get(source, 0) + 1
                continue
        else:
            items = topic_items(unit, topics[unit], max_tokens, count, seed)
        for p in items:
            if overlaps(p, banned):
                report.dropped_overlap[source] = report.dropped_overlap.get(source, 0) + 1
            else:
                kept.append((source, p))
    kept = kept[:max_items] if max_items else kept
    rng.shuffle(kept)  # a topic's chunks apart from each other
    for source, p in kept:
        report.items[source] = report.items.get(source, 0) + 1
        report.tokens[source] = report.tokens.get(source, 0) + sum(map(count, p.answers))
    return [p for _, p in kept], report


def write_prompts(path: str | os.PathLike, prompts: list[Prompt]) -> None:
    """One `turns`+`answers` record a line, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(asdict(p)) + "\n" for p in prompts))


# ---------------------------------------------------------------- mix


def mix_counts(n_regen: int, n_prefill: int, fraction: float) -> tuple[int, int]:
    """(regenerated, prefill) to use: as many as the inputs allow with prefill share `fraction`."""
    if not 0 <= fraction <= 1:
        raise CorpusError(f"--fraction {fraction}: the prefill share must be in [0, 1]")
    if fraction == 0:
        return n_regen, 0
    if fraction == 1:
        return 0, n_prefill
    want_p = round(n_regen * fraction / (1 - fraction))
    if want_p <= n_prefill:
        return n_regen, want_p
    return min(n_regen, round(n_prefill * (1 - fraction) / fraction)), n_prefill


def mix(
    regen_source: str | os.PathLike,
    prefill_jsonl: str | os.PathLike,
    out: str | os.PathLike,
    prefill_fraction: float,
    seed: int = 0,
) -> dict:
    """Write regenerated and prefill conversations, interleaved, as one complete prompt set.

    Prefill makes up `prefill_fraction` of the output (of every long prefix, roughly, since
    the order is a seeded shuffle); as many items are used as that share allows."""
    if not 0 <= prefill_fraction <= 1:
        raise CorpusError(f"--fraction {prefill_fraction}: the prefill share must be in [0, 1]")
    regen_dir, prefill = Path(regen_source), Path(prefill_jsonl)
    if not regen_dir.is_dir():
        raise CorpusError(
            f"--regen {regen_dir}: not a directory; pass the regeneration folder a capture "
            "wrote (e.g. CAPTURE/regen, with chunk-*.jsonl files)"
        )
    if not prefill.is_file():
        raise CorpusError(f"--prefill {prefill}: no such file; build one with `build --out`")
    try:
        regen = load_prompt_set(regen_dir)
        pre = load_prompt_set(prefill)
    except DataError as e:
        raise CorpusError(str(e)) from e
    for name, ps in (("--regen", regen), ("--prefill", pre)):
        if bad := [p.id for p in ps if not p.complete]:
            raise CorpusError(
                f"{name}: {len(bad)} conversations lack answers (first: {bad[0]}); the mix "
                "must be complete so the capture regenerates nothing"
            )
    n_r, n_p = mix_counts(len(regen), len(pre), prefill_fraction)
    rng = random.Random(seed)
    chosen = rng.sample(regen, n_r) + rng.sample(pre, n_p)
    ids = [p.id for p in chosen]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise CorpusError(f"id {dup!r} is in both inputs; ids must be unique across the mix")
    rng.shuffle(chosen)
    write_prompts(out, chosen)
    return {"regenerated": n_r, "prefill": n_p, "total": n_r + n_p, "out": str(out)}


def with_prefill(
    conversations: list[Prompt],
    tokenizer,
    fraction: float,
    seed: int = 0,
    max_tokens: int = 384,
) -> tuple[list[Prompt], dict]:
    """`conversations` (all kept: they are paid for) plus prefill items making up `fraction`
    of the result, or as many as the corpus holds; the capture notebook's `prefill_fraction`.

    Prefill items are captured without regeneration (~3x cheaper a token than answering)."""
    if not 0 <= fraction < 1:
        raise CorpusError(
            f"prefill_fraction {fraction}: the prefill share must be in [0, 1) (0 = none)"
        )
    if fraction == 0 or not conversations:
        return conversations, {}
    want = round(len(conversations) * fraction / (1 - fraction))
    pre, report = build(tokenizer, max_items=want, max_tokens=max_tokens, seed=seed)
    taken = {p.id for p in conversations}
    if clash := [p.id for p in pre if p.id in taken]:
        raise CorpusError(f"prefill id {clash[0]!r} is also a regenerated conversation's id")
    info = {
        "fraction": fraction,
        "regenerated": len(conversations),
        "prefill": len(pre),
        "prefill_tokens": sum(report.tokens.values()),
    }
    return conversations + pre, info


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m workbench.corpus", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build prefill items from pydoc topics and stdlib functions")
    b.add_argument("--out", required=True, help="output .jsonl")
    b.add_argument("--max-items", type=int, default=None, help="cap on items (default: all)")
    b.add_argument("--max-tokens", type=int, default=384, help="max tokens per answer")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--target", default="smollm2-135m", help="whose tokenizer counts tokens")
    m = sub.add_parser("mix", help="regenerated + prefill conversations into one prompt set")
    m.add_argument("--regen", required=True, help="regeneration directory (chunk-*.jsonl)")
    m.add_argument("--prefill", required=True, help="prefill .jsonl from `build`")
    m.add_argument("--out", required=True, help="output .jsonl")
    m.add_argument("--fraction", type=float, default=0.5, help="prefill share of the output")
    m.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            prompts, report = build(load_tokenizer(a.target), a.max_items, a.max_tokens, a.seed)
            write_prompts(a.out, prompts)
            print(f"wrote {len(prompts)} conversations to {a.out}\n{report.summary()}")
        else:
            info = mix(a.regen, a.prefill, a.out, a.fraction, a.seed)
            print(
                f"wrote {info['total']} conversations to {a.out}: "
                f"{info['regenerated']} regenerated, {info['prefill']} prefill"
            )
    except WorkbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
