"""Prompts the target writes itself: more user turns to regenerate training answers for.

Why: the built-in training set (`assets/train_prompts.jsonl`) caps how much regenerated data
we can make. The target can play the user: feed its chat template up to an opened user turn
(`<|im_start|>user\\n` for SmolLM2, after the system turn the template adds) and sample until
the end-of-turn marker. What comes back is filtered (length, non-ASCII, duplicates, overlap with
the built-in set and with the evals) and written as a prompt file `data.load_prompt_set` reads.

An optional category hint (one of the built-in set's categories, as a system message) spreads
the samples over topics.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from workbench.data import (
    eos_ids,
    load_humaneval,
    load_mtbench,
    load_train_prompts,
    prepare_conversations,
)
from workbench.errors import WorkbenchError
from workbench.fsutil import atomic_write_json, atomic_write_text

SENTINEL = "\x00WORKBENCH-USER-TURN\x00"
HINTS = ("none", "category")
# Drop reasons in the order they are checked; a prompt counts under the first that applies.
REASONS = ("empty", "truncated", "too_short", "too_long", "non_ascii", "eval_overlap",
           "train_overlap", "duplicate", "near_duplicate")  # fmt: skip


class SelfPromptError(WorkbenchError):
    """Self-prompting could not start or its arguments were wrong."""


# ---------------------------------------------------------------- the user-turn prefix


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """Chat-template text that opens a user turn (the template's default system turn first).

    Rendered with a sentinel as the user's content and cut at the sentinel, so whatever the
    template adds before a user message (a default system turn, a BOS) is kept exactly.
    """
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise SelfPromptError(
            "the chat template does not show the user's content verbatim once; cannot find "
            "where a user turn opens (self-prompting needs a plain-text chat template)"
        )
    return text[: text.index(SENTINEL)]


def category_hint(category: str) -> str:
    return f"The user asks the assistant for help with a {category} task."


# ---------------------------------------------------------------- text measures


def words(text: str) -> list[str]:
    """Lowercased words with punctuation stripped (the unit of every overlap test)."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}


def distinct_ngram_ratio(texts: Iterable[str], n: int = 3) -> float:
    """Distinct word n-grams / all word n-grams over a set of texts (1.0 = no repeats)."""
    total: list[tuple[str, ...]] = []
    for t in texts:
        ws = words(t)
        total += [tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)]
    return len(set(total)) / len(total) if total else 0.0


class NgramIndex:
    """Texts as word n-gram sets, with an inverted index for the max Jaccard of a new text."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sizes: list[int] = []
        self.postings: dict[tuple[str, ...], list[int]] = {}

    def add(self, ws: list[str]) -> None:
        grams = ngrams(ws, self.n)
        for g in grams:
            self.postings.setdefault(g, []).append(len(self.sizes))
        self.sizes.append(len(grams))

    def shares_any(self, ws: list[str]) -> bool:
        return any(g in self.postings for g in ngrams(ws, self.n))

    def max_jaccard(self, ws: list[str]) -> float:
        grams = ngrams(ws, self.n)
        shared = Counter(i for g in grams for i in self.postings.get(g, ()))
        return max((c / (len(grams) + self.sizes[i] - c) for i, c in shared.items()), default=0.0)


# ---------------------------------------------------------------- filters


@dataclass
class FilterConfig:
    min_words: int = 5
    max_words: int = 200
    max_non_ascii: float = 0.2  # fraction of characters
    near_dup_jaccard: float = 0.5  # word 5-grams, against kept and built-in prompts
    eval_ngram: int = 8  # any shared word 8-gram with an eval prompt rejects
    eval_jaccard: float = 0.3  # word 3-grams


class PromptFilter:
    """Decides keep or drop (with a reason) for each generated prompt; remembers what it kept."""

    def __init__(self, eval_texts: list[str], train_texts: list[str], cfg: FilterConfig) -> None:
        self.cfg = cfg
        self.eval_long, self.eval_tri = NgramIndex(cfg.eval_ngram), NgramIndex(3)
        for t in eval_texts:
            self.eval_long.add(words(t))
            self.eval_tri.add(words(t))
        self.train_norm = {" ".join(words(t)) for t in train_texts}
        self.train_5 = NgramIndex(5)
        for t in train_texts:
            self.train_5.add(words(t))
        self.kept_norm: set[str] = set()
        self.kept_5 = NgramIndex(5)

    def check(self, text: str, finished: bool = True) -> str | None:
        """The reason to drop `text` (one of REASONS), or None to keep it (and remember it)."""
        c, text = self.cfg, text.strip()
        ws = words(text)
        norm = " ".join(ws)
        if not norm:
            return "empty"
        if not finished:
            return "truncated"
        if len(text.split()) < c.min_words:
            return "too_short"
        if len(text.split()) > c.max_words:
            return "too_long"
        if sum(ord(ch) > 127 for ch in text) > c.max_non_ascii * len(text):
            return "non_ascii"
        if self.eval_long.shares_any(ws) or self.eval_tri.max_jaccard(ws) > c.eval_jaccard:
            return "eval_overlap"
        if norm in self.train_norm or self.train_5.max_jaccard(ws) > c.near_dup_jaccard:
            return "train_overlap"
        if norm in self.kept_norm:
            return "duplicate"
        if self.kept_5.max_jaccard(ws) > c.near_dup_jaccard:
            return "near_duplicate"
        self.kept_norm.add(norm)
        self.kept_5.add(ws)
        return None


def eval_texts() -> list[str]:
    """Every MT-bench turn and HumanEval prompt: generated prompts must not resemble them."""
    return [t for p in load_mtbench() + load_humaneval() for t in p.turns]


def default_filter(cfg: FilterConfig | None = None) -> PromptFilter:
    train = [t for p in load_train_prompts() for t in p.turns]
    return PromptFilter(eval_texts(), train, cfg or FilterConfig())


# ---------------------------------------------------------------- generation


@dataclass
class SelfPromptConfig:
    n: int = 256  # prompts to keep
    seed: int = 0
    batch_size: int = 64
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    hints: str = "category"  # none | category
    max_rounds: int = 3  # each round samples as many candidates as are still missing
    dtype: str = "auto"  # auto: bf16 only where bf16 matmuls are native (workbench.target)
    filters: FilterConfig = field(default_factory=FilterConfig)

    def __post_init__(self) -> None:
        for name in ("n", "batch_size", "max_new_tokens", "max_rounds"):
            if getattr(self, name) < 1:
                raise SelfPromptError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.hints not in HINTS:
            raise SelfPromptError(f"hints={self.hints!r}: expected one of {HINTS}")
        if self.temperature <= 0:
            raise SelfPromptError(
                f"temperature={self.temperature}: self-prompting samples (greedy would write "
                "one prompt over and over); use e.g. 1.0"
            )
        if not 0 < self.top_p <= 1:
            raise SelfPromptError(f"top_p={self.top_p}: must be in (0, 1]")


def categories() -> list[str]:
    return sorted({p.category for p in load_train_prompts()})


def generate_prompts(target, cfg: SelfPromptConfig, progress: bool = True) -> tuple[list, dict]:
    """Sample user turns from `target` until `cfg.n` pass the filters (or rounds run out).

    Returns (kept records in the built-in `id`/`category`/`turns` form, stats)."""
    from workbench.generate import generate_batch_with_stats
    from workbench.llama import Llama
    from workbench.target import fast_dtype

    cfg = replace(cfg, dtype=fast_dtype(cfg.dtype, str(next(target.model.parameters()).device)))
    tok, filt = target.tokenizer, default_filter(cfg.filters)
    eos = eos_ids(tok)
    cats = categories()
    llm = Llama(target.model, cfg.dtype)
    prefixes: dict[str, list[int]] = {}

    def prefix_ids(cat: str) -> list[int]:
        if cat not in prefixes:
            text = user_turn_prefix(tok, category_hint(cat) if cfg.hints == "category" else None)
            prefixes[cat] = tok(text, add_special_tokens=False)["input_ids"]
        return prefixes[cat]

    kept: list[dict] = []
    dropped = Counter({r: 0 for r in REASONS})
    generated, new_tokens, seconds, rounds = 0, 0, 0.0, 0
    while len(kept) < cfg.n and rounds < cfg.max_rounds:
        todo = cfg.n - len(kept)
        rng = random.Random(cfg.seed * 1000 + rounds)
        hint_cats = [rng.choice(cats) if cfg.hints == "category" else "self" for _ in range(todo)]
        ids = [prefix_ids(c) for c in hint_cats]
        outs, st = generate_batch_with_stats(
            llm, ids, cfg.max_new_tokens, eos, temperature=cfg.temperature, top_p=cfg.top_p,
            seed=cfg.seed * 1000 + rounds, batch_size=cfg.batch_size, dtype=cfg.dtype,
            progress=progress,
        )  # fmt: skip
        rounds += 1
        generated += len(outs)
        new_tokens += st.new_tokens
        seconds += st.seconds
        for c, toks in zip(hint_cats, outs, strict=True):
            finished = bool(toks) and toks[-1] in eos
            text = tok.decode([t for t in toks if t not in eos], skip_special_tokens=True).strip()
            why = filt.check(text, finished)
            if why is not None:
                dropped[why] += 1
            elif len(kept) < cfg.n:
                kept.append({"id": f"self-{len(kept) + 1:05d}", "category": c, "turns": [text]})
    stats = {
        "n_requested": cfg.n,
        "n_generated": generated,
        "n_kept": len(kept),
        "kept_fraction": round(len(kept) / generated, 4) if generated else 0.0,
        "dropped": dict(dropped),
        "rounds": rounds,
        "new_tokens": new_tokens,
        "seconds": round(seconds, 2),
        "tok_s": round(new_tokens / seconds, 2) if seconds else None,
        "distinct_3gram_ratio": round(distinct_ngram_ratio(r["turns"][0] for r in kept), 4),
        "seed": cfg.seed,
        "target": getattr(target, "fingerprint", None),
        "config": asdict(cfg),
    }
    return kept, stats


def stats_path(out: str | os.PathLike) -> Path:
    """The stats sidecar next to a prompt file: `x.jsonl` -> `x.stats.json`."""
    return Path(out).with_suffix(".stats.json")


def write_prompts(
    target, out: str | os.PathLike, cfg: SelfPromptConfig, progress: bool = True
) -> dict:
    """Generate, filter and write `out` (JSONL, atomic) plus its stats sidecar; returns stats."""
    out = Path(out)
    if out.suffix != ".jsonl":
        raise SelfPromptError(f"--out {out}: expected a .jsonl file name")
    if not out.parent.is_dir():
        raise SelfPromptError(f"--out {out}: folder {out.parent} does not exist; create it first")
    t0 = time.perf_counter()
    kept, stats = generate_prompts(target, cfg, progress=progress)
    stats["wall_seconds"] = round(time.perf_counter() - t0, 2)
    stats["out"] = str(out)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in kept))
    atomic_write_json(stats_path(out), stats)
    return stats


# ---------------------------------------------------------------- as a capture stage

# What makes a prompt file the same one on a rerun (dtype and batch size only change speed).
IDENTITY = ("n", "seed", "max_new_tokens", "temperature", "top_p", "hints", "max_rounds",
            "filters")  # fmt: skip


def check_count(n: int) -> None:
    if n < 0:
        raise SelfPromptError(f"self_prompts={n}: must be 0 (none) or a number of prompts")


def with_self_prompts(
    target,
    conversations: list,
    n: int,
    out_dir: str | os.PathLike,
    regen=None,
    cfg: SelfPromptConfig | None = None,
    progress: bool = True,
) -> tuple[list, dict]:
    """`conversations` plus up to `n` prompts the target writes itself, answered like the
    others; the capture notebook's `self_prompts`. 0 adds nothing.

    The prompts go to `out_dir/prompts.jsonl` (written once, atomically; a rerun with the
    same settings reuses them) and their answers to `out_dir/regen` (resumable by chunk)."""
    check_count(n)
    if n == 0:
        return conversations, {}
    cfg = replace(cfg or SelfPromptConfig(), n=n)
    out_dir = Path(out_dir)
    path = out_dir / "prompts.jsonl"
    if path.exists() and stats_path(path).exists():
        stats = json.loads(stats_path(path).read_text())
        mine = {k: asdict(cfg)[k] for k in IDENTITY}
        theirs = {k: stats["config"].get(k) for k in IDENTITY}
        if mine != theirs or stats.get("target") != getattr(target, "fingerprint", None):
            diff = sorted(k for k in IDENTITY if mine[k] != theirs[k]) or ["target"]
            raise SelfPromptError(
                f"{path} was written with other settings ({', '.join(diff)} differ); delete "
                f"{out_dir} to write new prompts, or capture into another folder"
            )
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        stats = write_prompts(target, path, cfg, progress=progress)
    if stats["n_kept"] == 0:
        raise SelfPromptError(
            f"the target kept none of its {stats['n_generated']} prompts (dropped: "
            f"{stats['dropped']}); see {stats_path(path)}, or set self_prompts=0"
        )
    mine, info = prepare_conversations(target, path, None, out_dir / "regen", regen, progress)
    taken = {p.id for p in conversations}
    if clash := [p.id for p in mine if p.id in taken]:
        raise SelfPromptError(f"self-prompt id {clash[0]!r} is also another conversation's id")
    info |= {k: stats[k] for k in ("n_requested", "n_kept", "n_generated", "dropped")}
    info["prompt_seconds"] = stats.get("wall_seconds")
    return conversations + mine, info
