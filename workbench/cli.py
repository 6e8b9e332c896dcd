"""`workbench ...` command line (Typer). Each command is a thin wrapper over a package function."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from workbench.errors import WorkbenchError


class _Commands(TyperGroup):
    """Runs every command under one catch: an error the user can fix (a `WorkbenchError`)
    is printed as `error: <message>` on stderr with exit code 2; anything else is a bug and
    keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except WorkbenchError as e:
            _fail(str(e))


app = typer.Typer(cls=_Commands, no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def info(
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
) -> None:
    """Load a target and print its description and fingerprint."""
    import json

    from workbench.target import load_target

    t = load_target(target)
    typer.echo(json.dumps(t.describe(), indent=2))


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def regenerate(
    prompts: str = typer.Option("train", help="'train', 'mtbench', 'humaneval', or a .jsonl file"),
    out: str = typer.Option(..., help="output directory (resumable)"),
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    n: int = typer.Option(0, help="use only N prompts (0 = all)"),
    pick: str = typer.Option("first", help="which N: first, or spread (evenly over the set)"),
    max_new_tokens: int = typer.Option(512),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    samples: int = typer.Option(1, help="answers per prompt; extra ones are sampled"),
    sample_temperature: float = typer.Option(0.8, help="temperature of the extra answers"),
    batch_size: int = typer.Option(64),
    dtype: str = typer.Option("auto", help="generation dtype; auto: bf16 only if native"),
    seed: int = typer.Option(0),
) -> None:
    """Have the target answer a prompt set with its chat template (the data EAGLE-3 trains on)."""
    from workbench.data import RegenConfig, check_n, check_pick, load_prompt_set, select
    from workbench.data import regenerate as regen
    from workbench.target import load_target

    # RegenConfig validates its fields before anything is loaded or written
    cfg = RegenConfig(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size,
                      dtype=dtype, seed=seed, samples=samples,
                      sample_temperature=sample_temperature)  # fmt: skip
    check_n(n)
    check_pick(pick)
    t = load_target(target)
    ps = select(load_prompt_set(prompts), n or None, pick=pick)
    info = regen(t, ps, out, cfg)
    typer.echo(
        f"regenerated {len(ps)} prompts into {out}: {info['new_tokens_this_run']} new tokens, "
        f"{info['tok_s']} tok/s"
    )


@app.command()
def prompts(
    n: int = typer.Option(..., "--n", help="prompts to keep (after the filters)"),
    out: str = typer.Option(..., "--out", help="prompt file (.jsonl; stats go to .stats.json)"),
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    seed: int = typer.Option(0),
    batch_size: int = typer.Option(64),
    max_new_tokens: int = typer.Option(96, help="longest prompt sampled; longer ones are dropped"),
    hints: str = typer.Option("category", help="none | category (a topic per prompt)"),
    max_rounds: int = typer.Option(3, help="sampling rounds to reach --n after drops"),
) -> None:
    """Grow the prompt set: the target writes user turns, filtered against evals and duplicates."""
    from workbench.selfprompts import SelfPromptConfig, write_prompts
    from workbench.target import load_target

    cfg = SelfPromptConfig(n=n, seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           hints=hints, max_rounds=max_rounds)  # fmt: skip
    st = write_prompts(load_target(target), out, cfg)
    drops = ", ".join(f"{k} {v}" for k, v in st["dropped"].items() if v)
    typer.echo(f"kept {st['n_kept']}/{st['n_generated']} prompts into {out} ({st['tok_s']} "
               f"tok/s); dropped: {drops or 'none'}")  # fmt: skip


@app.command()
def capture(
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    prompts: str = typer.Option(
        "train", help="prompt set: 'train', 'mtbench', 'humaneval', a .jsonl, or a regeneration dir"
    ),
    out: str = typer.Option(..., help="capture directory (resumable; refuses other arguments)"),
    n: int = typer.Option(0, help="use only N prompts (0 = all)"),
    pick: str = typer.Option("first", help="which N: first, or spread (evenly over the set)"),
    max_length: int = typer.Option(2048, help="truncate conversations to this many tokens"),
    layers: str = typer.Option(
        "default", help="aux layer ids, e.g. '1,14,26', or 'default' ([1, N//2-1, N-4])"
    ),
    convention: str = typer.Option(
        "output_of_layer",
        help="convention of --layers: output_of_layer | hf_hidden_states_index | input_of_layer",
    ),
    dtype: str = typer.Option("bfloat16", help="storage dtype of hidden states"),
    target_dtype: str = typer.Option("float32", help="compute dtype of the target"),
    device: str = typer.Option("cpu", help="cpu, cuda, or 'auto' (device_map=auto over GPUs)"),
    regen_dir: str = typer.Option("", help="where answers are regenerated (default: OUT/regen)"),
    max_new_tokens: int = typer.Option(512, help="regeneration length for prompts without answers"),
    batch_tokens: int = typer.Option(8192, help="padded tokens per capture forward"),
    samples: int = typer.Option(
        1, help="answers per regenerated prompt: the first greedy, the others sampled"
    ),
    sample_temperature: float = typer.Option(0.8, help="temperature of the extra answers"),
    self_prompts: int = typer.Option(0, help="plus N prompts the target writes (in OUT/self)"),
    backend: str = typer.Option(
        "hf", help="hf (forward hooks) | sglang (aux states from SGLang, launched or --sglang-url)"
    ),
    sglang_url: str = typer.Option("", help="attach to a running SGLang capture server"),
    tp_size: int = typer.Option(1, help="tensor parallelism of the launched SGLang server"),
) -> None:
    """Capture aux hidden states (+ final hidden) into shards + manifest.json."""
    import contextlib
    from pathlib import Path

    from workbench.capture import CaptureConfig
    from workbench.capture import capture as run_capture
    from workbench.data import RegenConfig, base_id, check_n, check_pick, prepare_conversations
    from workbench.layers import parse_layer_spec
    from workbench.selfprompts import check_count, with_self_prompts
    from workbench.target import load_target

    # Every argument is checked before anything is written (the regeneration comes first).
    regen = RegenConfig(max_new_tokens=max_new_tokens, samples=samples,
                        sample_temperature=sample_temperature)  # fmt: skip
    check_n(n)
    check_pick(pick)
    check_count(self_prompts)
    dm = "auto" if device == "auto" else None
    t = load_target(target, dtype=target_dtype, device="cpu" if dm else device, device_map=dm)
    ids = parse_layer_spec(layers, t.num_layers, convention)
    cfg = CaptureConfig(ids, dtype=dtype, max_length=max_length, batch_tokens=batch_tokens)
    if backend not in ("hf", "sglang"):
        raise typer.BadParameter(f"--backend must be hf or sglang, got {backend!r}")
    rdir = regen_dir or Path(out) / "regen"
    ps, info = prepare_conversations(t, prompts, n or None, rdir, regen, pick=pick)
    ps, info["self"] = with_self_prompts(t, ps, self_prompts, Path(out) / "self", regen)
    with contextlib.ExitStack() as stack:
        rec = {}
        if backend == "sglang":
            from workbench.serving import capture_sglang as cs

            url = sglang_url
            if not url:
                spec = cs.capture_spec(str(t.path), ids, t.num_layers, tp_size=tp_size,
                                       dtype=target_dtype, device="cpu" if device == "cpu" else "cuda")  # fmt: skip
                log = Path("reports/serve") / f"sglang-capture-{Path(out).name}.log"
                typer.echo(f"starting SGLang capture server (log: {log})")
                url = stack.enter_context(cs.capture_server(spec, log))
            rec = {"recorder": cs.recorder(url)}
        m = run_capture(
            t,
            [p.messages() for p in ps],
            out,
            cfg,
            prompt_set=info,
            groups=[base_id(p.id) for p in ps],
            **rec,
        )
    typer.echo(
        f"captured {m['num_samples']} samples, {m['num_tokens']} tokens "
        f"({m['num_loss_tokens']} assistant) at layers {m['layer_ids']} into {out}"
    )


@app.command()
def verify(capture_dir: str = typer.Argument(..., help="capture directory to check")) -> None:
    """Check a capture: every shard's sha256 against the manifest and its layer ids.

    Exits 2 naming the first bad shard; 0 when every shard is intact."""
    import time

    from workbench.capture import CaptureReader

    t0 = time.perf_counter()
    r = CaptureReader(capture_dir, verify=True)
    size = sum((r.path / e["file"]).stat().st_size for e in r.manifest["shards"])
    typer.echo(
        f"{capture_dir}: {len(r.manifest['shards'])} shards ({size / 1e6:.1f} MB, {len(r)} "
        f"samples, layers {r.layer_ids}) intact, checked in {time.perf_counter() - t0:.2f}s"
    )


@app.command("import-data")
def import_data(
    path: str = typer.Argument(..., help="JSONL in ShareGPT or OpenAI-messages form"),
) -> None:
    """Check a user data file: counts kept conversations and lists malformed lines."""
    from workbench.data import import_jsonl

    _, report = import_jsonl(path)
    typer.echo(report.summary())
    if report.kept == 0:
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    notebook: str = typer.Argument(
        ..., help="notebook to execute (.ipynb with a tagged parameters cell)"
    ),
    params_file: list[str] = typer.Option(
        [], "-f", "--parameters-file", help="YAML mapping of parameters (repeatable)"
    ),
    reports_dir: str = typer.Option("reports", help="where run directories and index.html go"),
    run_id: str = typer.Option(
        "", "--run-id", help="put the notebook into this run directory (default: a new one)"
    ),
    kernel: str = typer.Option("", "--kernel", help="kernel name (default: the notebook's)"),
    log_output: bool = typer.Option(
        False, "--log-output", help="stream the notebook's output here"
    ),
) -> None:
    """Execute NOTEBOOK with papermill into reports/<run-id>/ (+ HTML, run manifest, index).

    Parameters: -p NAME VALUE (repeatable; values parsed like papermill: int, float, bool, str)."""
    from workbench.report import load_parameters, run_notebook

    if not notebook.endswith(".ipynb"):
        _fail(
            f"{notebook!r} is not a notebook; usage: workbench run NOTEBOOK.ipynb [-p NAME VALUE ...]"
        )
    pairs, extra = [], list(ctx.args)
    while extra:
        flag = extra.pop(0)
        if flag not in ("-p", "--parameters") or len(extra) < 2:
            _fail(f"unexpected argument {flag!r}; parameters are given as -p NAME VALUE")
        pairs.append((extra.pop(0), extra.pop(0)))
    params = load_parameters(params_file, pairs)
    r = run_notebook(
        notebook,
        params,
        reports_dir,
        run_id or None,
        kernel or None,
        progress_bar=True,
        log_output=log_output,
    )
    typer.echo(f"{r.notebook}: {r.status} in {r.duration_s:.1f}s -> {r.html}")
    if r.figures:
        typer.echo("figures: " + ", ".join(f"{k}={v}" for k, v in r.figures.items()))


@app.command()
def pipeline(
    profile: str = typer.Option("quick", help="quick (18-47 min on 2 cores) or full (~2 h)"),
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    reports_dir: str = typer.Option("reports", "--reports-dir"),
    force: bool = typer.Option(False, "--force", help="rerun stages whose inputs are unchanged"),
    browser_check: bool = typer.Option(
        True, help="open each HTML report in headless Chromium when available"
    ),
    experiments: bool = typer.Option(
        False, help="also run 05 (step sweep) and 06 (all-reduce, TP scaling)"
    ),
) -> None:
    """Run notebooks 01 (capture) -> 02 (train) -> 03 (inspect) -> 04 (serve) as one report run."""
    from workbench.pipeline import stages
    from workbench.report import check_html_in_browser, find_chromium, run_stages

    todo = stages(profile, target, experiments)
    results = run_stages(todo, reports_dir, force=force, progress_bar=True)
    done = ", ".join(f"{r.notebook} {r.status}" for r in results)
    typer.echo(f"run {results[0].run_id}: {done}")
    figures = {k: v for r in results for k, v in r.figures.items()}
    if figures:
        typer.echo("key figures: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    if browser_check and find_chromium():
        for r in results:
            if r.status == "ok":
                res = check_html_in_browser(r.html, screenshot=r.html.with_suffix(".png"))
                typer.echo(
                    f"browser check {r.html.name}: {res['rendered_plots']}/{res['plots']} plots rendered, "
                    f"{len(res['js_errors'])} JS errors -> {res['screenshot']}"
                )
    typer.echo(f"open {reports_dir}/index.html")


@app.command()
def index(reports_dir: str = typer.Option("reports", "--reports-dir")) -> None:
    """Regenerate reports/index.html from the run manifests."""
    from workbench.report import write_index

    typer.echo(str(write_index(reports_dir)))


@app.command()
def compare(
    run_a: str = typer.Argument(..., help="run id"),
    run_b: str = typer.Argument(..., help="run id"),
    reports_dir: str = typer.Option("reports", "--reports-dir"),
) -> None:
    """Write reports/compare-A-vs-B.html: parameters and key figures side by side, diffs marked."""
    from workbench.report import compare_runs

    typer.echo(str(compare_runs(run_a, run_b, reports_dir)))


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def train(ctx: typer.Context) -> None:
    """Train an EAGLE-3 draft (TTT, resumable): --capture DIR --out DIR [--preset quick|full] ...

    All options of `python -m workbench.draft.train` (see `workbench train --help`)."""
    from workbench.draft.train import main

    raise typer.Exit(main(list(ctx.args)))


@app.command("export")
def export_draft(
    draft: str = typer.Option(
        ..., "--draft", help="training run dir, checkpoint dir, or an export dir to convert"
    ),
    fmt: str = typer.Option("sglang", "--format", help="sglang | speculators"),
    out: str = typer.Option(..., "--out", help="export directory (written atomically)"),
    verifier: str = typer.Option("", help="speculators: verifier (target) name or path"),
    speculative_tokens: int = typer.Option(3, help="speculators: draft tokens per step"),
    dtype: str = typer.Option("", help="float32 | bfloat16 | float16 (default: as trained)"),
    target_max_positions: int = typer.Option(
        0,
        "--target-max-position-embeddings",
        help="refuse a draft whose context is shorter than the target's",
    ),
) -> None:
    """Export a draft in the layout SGLang (--speculative-draft-model-path) or vLLM loads."""
    from workbench.draft import export as ex
    from workbench.draft.load import load_draft

    if fmt not in ex.FORMATS:
        _fail(f"--format must be one of {', '.join(ex.FORMATS)}, got {fmt!r}")
    if fmt != ex.SGLANG and not verifier:
        _fail("--format speculators needs --verifier (the target's hub id or path)")
    loaded = load_draft(draft)
    d, prov, warns = loaded.draft, ex.reexport_provenance(loaded), loaded.warnings
    kw = dict(dtype=dtype or None, target_max_position_embeddings=target_max_positions or None)
    if fmt == ex.SGLANG:
        path = ex.export_sglang(d, out, prov, **kw)
    else:
        path = ex.export_speculators(d, out, verifier, speculative_tokens, prov, **kw)
    for w in warns:
        typer.secho(f"warning (source): {w}", fg=typer.colors.YELLOW, err=True)
    ids = d.config.layer_ids
    typer.echo(f"exported {fmt} draft to {path} (aux layers {list(ids.canonical)} output_of_layer)")


@app.command("import-draft")
def import_draft_cmd(
    path: str = typer.Argument(..., help="SGLang/SpecForge/EAGLE or speculators draft directory"),
    layer_convention: str = typer.Option(
        "", "--layer-convention", help="output_of_layer | input_of_layer | hf_hidden_states_index"
    ),
    layer_ids: str = typer.Option("", help="ids when the config has none, e.g. '1,14,26'"),
    target_max_positions: int = typer.Option(0, "--target-max-position-embeddings"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 when anything is flagged"),
) -> None:
    """Load an outside draft for inspection: print its shape, wiring and what looks wrong."""
    from workbench.draft.load import load_draft

    imp = load_draft(
        path,
        layer_ids=layer_ids or None,
        layer_convention=layer_convention or None,
        target_max_position_embeddings=target_max_positions or None,
    )
    typer.echo(imp.summary())
    if strict and imp.warnings:
        raise typer.Exit(1)


@app.command()
def audit(
    draft: str = typer.Option(..., "--draft", help="draft export dir (or training run dir)"),
    capture: str = typer.Option("", "--capture", help="capture directory the draft was trained on"),
    serving: str = typer.Option(
        "", "--serving", help='serving command line, e.g. "python -m sglang.launch_server ..."'
    ),
    target: str = typer.Option("", help="target (HF dir, .gguf, 'smollm2-135m') to check against"),
    wiring: bool = typer.Option(
        False, "--wiring", help="also run the teacher-forced wiring audit (ends with RESULT)"
    ),
) -> None:
    """Config audit: draft vs capture vs serving command (layer ids, vocab, positions, flags);
    exits 1 on an error. --wiring: the teacher-forced wiring audit (workbench/wiring.py); its
    last line is `RESULT verdict=... best=... delta_lo=... delta_hi=...`; shifted_wins or a
    flagged norm check (per-token norms on the capture's own tokens) exits 1."""
    from workbench.audit import config_audit
    from workbench.findings import format_findings, has_errors
    from workbench.target import load_target

    tgt = load_target(target) if target else None
    findings = config_audit(draft, capture or None, serving or None, target=tgt)
    typer.echo(format_findings(findings))
    bad_wiring = False
    if wiring:
        from workbench.wiring import SHIFTED_WINS, audit_draft_dir

        tf = audit_draft_dir(draft, capture or None, target or None)
        typer.echo(tf.format())
        typer.echo(tf.result_line())
        bad_wiring = tf.verdict == SHIFTED_WINS or any(n.flag for n in tf.norms)
    if has_errors(findings) or bad_wiring:
        raise typer.Exit(1)


@app.command()
def serve(
    backend: str = typer.Option("local", help="local (the embedded engine) | sglang"),
    url: str = typer.Option("", "--url", help="attach to a running server instead of launching"),
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    draft: str = typer.Option("", help="draft export or training run; empty: no speculation"),
    num_steps: int = typer.Option(0, help="--speculative-num-steps (0 with the next two: auto)"),
    eagle_topk: int = typer.Option(0, help="--speculative-eagle-topk"),
    num_draft_tokens: int = typer.Option(0, help="--speculative-num-draft-tokens"),
    tp_size: int = typer.Option(1, help="tensor parallelism (sglang backend only)"),
    dtype: str = typer.Option("float32"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(0, help="0 picks a free port"),
    trace_dir: str = typer.Option("", help="write trace-rank<R>.jsonl here (notebook 04's)"),
    trace_hidden: bool = typer.Option(False, help="also trace per-aux-layer norms (wiring check)"),
    log: str = typer.Option("", help="server log (default reports/serve/<backend>-<port>.log)"),
    deadline: float = typer.Option(600.0, help="seconds to wait for /health"),
) -> None:
    """Launch a server (or attach with --url), print its URL and exact argv, serve until Ctrl-C."""
    import shlex
    import time
    from dataclasses import replace
    from pathlib import Path

    from workbench.errors import InUseError
    from workbench.serving import process
    from workbench.serving.client import get_server_info

    if backend not in ("local", "sglang"):
        _fail(f"--backend must be local or sglang, got {backend!r}")
    if url:
        process.attach(url)
        info = get_server_info(url)
        typer.echo(f"attached to {url.rstrip('/')}")
        keys = ("version", "model_path", "tp_size", "speculative_algorithm",
                "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")  # fmt: skip
        typer.echo(", ".join(f"{k}={info.get(k)}" for k in keys if k in info))
        return
    from workbench.serving.local import LocalConfig, resolve_spec
    from workbench.serving.session import traced

    spec = [v or None for v in (num_steps, eagle_topk, num_draft_tokens)]
    cfg = LocalConfig(model_path=target, draft=draft, num_steps=spec[0], eagle_topk=spec[1],
                      num_draft_tokens=spec[2], dtype=dtype)  # fmt: skip
    resolve_spec(cfg)  # bad settings fail here, not in the child's log
    if port and process.port_in_use(host, port):
        raise InUseError(f"port {port} on {host} is in use; pick another --port or 0 for a "
                         "free one")  # fmt: skip
    if backend == "sglang":
        from workbench.serving import sglang
        from workbench.serving.session import sglang_spec

        ss = replace(sglang_spec(cfg, tp_size), host=host, port=port or process.free_port(host))
        ss = traced(ss, trace_dir, trace_hidden)  # the workbench_trace plugin (make sglang-env)
        log_path = Path(log or time.strftime("reports/serve/sglang-%Y%m%d-%H%M%S.log"))
        typer.echo("argv: " + shlex.join(sglang.command(ss)))
        server = sglang.launch(ss, log_path, deadline_s=deadline)
        _wait_served(server, log_path)
        return
    if tp_size != 1:
        _fail("the local backend runs in one process (--tp-size 1); use --backend sglang for "
              "tensor parallelism")  # fmt: skip
    cfg = traced(cfg, trace_dir, trace_hidden)
    port = port or process.free_port(host)
    argv = cfg.argv(host, port)
    log_path = Path(log or f"reports/serve/local-{port}.log")
    typer.echo("argv: " + shlex.join(argv))
    _wait_served(process.start(argv, log_path, f"http://{host}:{port}", deadline_s=deadline),
                 log_path)  # fmt: skip


def _wait_served(server, log_path) -> None:
    """Serve until Ctrl-C (then tear down) or until the server exits by itself (an error)."""
    from workbench.serving import process

    with server:
        typer.echo(f"serving at {server.url} (healthy after {server.start_s:.1f} s; log "
                   f"{log_path}); Ctrl-C stops it")  # fmt: skip
        try:
            code = server.proc.wait()
        except KeyboardInterrupt:
            typer.echo("stopping")
            return
    _fail(f"server exited with code {code}; log {log_path}:\n{process.log_tail(log_path)}")


@app.command()
def load(
    url: str = typer.Option(..., "--url", help="server base URL (workbench serve prints it)"),
    prompts: str = typer.Option("mtbench", help="mtbench | humaneval | a .jsonl file"),
    n: int = typer.Option(16, help="number of prompts, first turns (0 = all)"),
    target: str = typer.Option(
        "smollm2-135m", help="tokenizer + chat template, sent as input_ids ('' sends raw text)"
    ),
    max_new_tokens: int = typer.Option(128),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    concurrency: int = typer.Option(1, help="requests in flight at most"),
    request_rate: float = typer.Option(0.0, help="requests/s, Poisson arrivals (0 = no limit)"),
    stream: bool = typer.Option(True, help="stream (needed for TTFT/ITL)"),
    ignore_eos: bool = typer.Option(False),
    out: str = typer.Option("", help="results file (default reports/load/load-<UTC time>.json)"),
) -> None:
    """Send a prompt set to a server (local or SGLang) and write one results file.

    Exits 1 when the run is partial (the server died, requests failed) or SGLang's identities
    fail on any request."""
    import time

    from workbench.serving import client as lc

    tok = lc.load_tokenizer(target) if target else None
    reqs = lc.build_requests(prompts, n or None, tok)
    cfg = lc.LoadConfig(url, max_new_tokens=max_new_tokens, temperature=temperature,
                        concurrency=concurrency, request_rate=request_rate or float("inf"),
                        stream=stream, ignore_eos=ignore_eos)  # fmt: skip
    path = out or time.strftime("reports/load/load-%Y%m%d-%H%M%S.json", time.gmtime())
    run = lc.run_load(cfg, reqs, path)
    typer.echo(lc.format_summary(run))
    if run.status != "complete" or not run.summary["identities_ok"]:
        raise typer.Exit(1)


@app.command()
def sweep(
    draft: str = typer.Option("", help="draft run/export; empty: the demo's (make demo)"),
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    backend: str = typer.Option("engine", help="engine (in process) | local | sglang (served)"),
    steps: str = typer.Option("1,2,3,4,5", help="speculative_num_steps values"),
    topk: str = typer.Option("1", help="speculative_eagle_topk values"),
    ndt: str = typer.Option("0", help="speculative_num_draft_tokens values; 0 = steps + 1"),
    batch: str = typer.Option("1", help="batch sizes (client concurrency when served)"),
    n_prompts: int = typer.Option(4, help="MT-bench first turns, the same for every config"),
    max_new_tokens: int = typer.Option(48),
    dtype: str = typer.Option("float32"),
    calibration: int = typer.Option(3, help="speculative configs the cost model is fitted on"),
    tp_size: int = typer.Option(1, help="sglang backend only"),
    out: str = typer.Option("", help="sweep folder (resumable); empty: under $WORKBENCH_HOME"),
) -> None:
    """Step-count sweep (resumable; the baseline always included) + the cost model's pick."""
    from workbench.experiments import steps as st
    from workbench.pipeline import default_draft_dir

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x.strip()]

    res = st.run_step_sweep(
        out or None, backend=backend, target=target, draft=draft or str(default_draft_dir()),
        num_steps=ints(steps), eagle_topk=ints(topk), num_draft_tokens=[n or None for n in ints(ndt)],
        batch_size=ints(batch), n_prompts=n_prompts, max_new_tokens=max_new_tokens, dtype=dtype,
        calibration=calibration, tp_size=tp_size,
    )  # fmt: skip
    typer.echo(f"sweep folder {res['out_dir']}")
    for cfg, why in res["rejected"]:
        s_k_n = f"{cfg['num_steps']}/{cfg['eagle_topk']}/{cfg['num_draft_tokens']}"
        typer.echo(f"not run: {s_k_n}: {why}")
    for r in res["rows"]:
        if r["status"] != "ok":
            typer.echo(f"FAILED {r['label']}: {r['error']}")
    if res["report"] is None:
        _fail(f"no cost model: {res['model_error']}")
    typer.echo(st.format_table(res["report"]))
    if warn := st.drift_warning(res["report"]):
        typer.echo(warn)
    typer.echo(st.result_line(res["report"]))


if __name__ == "__main__":
    app()
