"""`workbench ...` command line (Typer). Each command is a thin wrapper over a package function."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def info(target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'")) -> None:
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
    n: int = typer.Option(0, help="use only the first N prompts (0 = all)"),
    max_new_tokens: int = typer.Option(512),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    batch_size: int = typer.Option(32),
    dtype: str = typer.Option("bfloat16", help="compute dtype for generation"),
    seed: int = typer.Option(0),
) -> None:
    """Have the target answer a prompt set with its chat template (the data EAGLE-3 trains on)."""
    from workbench.data import DataError, RegenConfig, load_prompt_set, select
    from workbench.data import regenerate as regen
    from workbench.target import TargetError, load_target

    try:
        t = load_target(target)
        ps = select(load_prompt_set(prompts), n or None)
        info = regen(t, ps, out, RegenConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                             batch_size=batch_size, dtype=dtype, seed=seed))
    except (DataError, TargetError) as e:
        _fail(str(e))
    typer.echo(f"regenerated {len(ps)} prompts into {out}: {info['new_tokens_this_run']} new tokens, "
               f"{info['tok_s']} tok/s")


@app.command()
def capture(
    target: str = typer.Option("smollm2-135m", help="HF dir, .gguf file or 'smollm2-135m'"),
    prompts: str = typer.Option("train", help="prompt set: 'train', 'mtbench', 'humaneval', a .jsonl, or a regeneration dir"),
    out: str = typer.Option(..., help="capture directory (resumable; refuses other arguments)"),
    n: int = typer.Option(0, help="use only the first N prompts (0 = all)"),
    max_length: int = typer.Option(2048, help="truncate conversations to this many tokens"),
    layers: str = typer.Option("default", help="aux layer ids, e.g. '1,14,26', or 'default' ([1, N//2-1, N-4])"),
    convention: str = typer.Option("output_of_layer", help="convention of --layers: output_of_layer | hf_hidden_states_index | input_of_layer"),
    dtype: str = typer.Option("bfloat16", help="storage dtype of hidden states"),
    target_dtype: str = typer.Option("float32", help="compute dtype of the target"),
    device: str = typer.Option("cpu", help="cpu, cuda, or 'auto' (device_map=auto over several GPUs)"),
    regen_dir: str = typer.Option("", help="where answers are regenerated (default: OUT/regen)"),
    max_new_tokens: int = typer.Option(512, help="regeneration length for prompts without answers"),
    batch_tokens: int = typer.Option(8192, help="padded tokens per capture forward"),
) -> None:
    """Capture aux hidden states (+ final hidden) into shards + manifest.json."""
    from pathlib import Path

    from workbench.capture import CaptureConfig, CaptureError
    from workbench.capture import capture as run_capture
    from workbench.data import DataError, RegenConfig, prepare_conversations
    from workbench.layers import LayerConventionError, parse_layer_spec
    from workbench.target import TargetError, load_target

    try:
        dm = "auto" if device == "auto" else None
        t = load_target(target, dtype=target_dtype, device="cpu" if dm else device, device_map=dm)
        ids = parse_layer_spec(layers, t.num_layers, convention)
        ps, info = prepare_conversations(t, prompts, n or None, regen_dir or Path(out) / "regen",
                                         RegenConfig(max_new_tokens=max_new_tokens))
        m = run_capture(t, [p.messages() for p in ps], out,
                        CaptureConfig(ids, dtype=dtype, max_length=max_length, batch_tokens=batch_tokens),
                        prompt_set=info)
    except (CaptureError, DataError, TargetError, LayerConventionError) as e:
        _fail(str(e))
    typer.echo(f"captured {m['num_samples']} samples, {m['num_tokens']} tokens "
               f"({m['num_loss_tokens']} assistant) at layers {m['layer_ids']} into {out}")


@app.command("import-data")
def import_data(path: str = typer.Argument(..., help="JSONL in ShareGPT or OpenAI-messages form")) -> None:
    """Check a user data file: counts kept conversations and lists malformed lines."""
    from workbench.data import DataError, import_jsonl

    try:
        _, report = import_jsonl(path)
    except DataError as e:
        _fail(str(e))
    typer.echo(report.summary())
    if report.kept == 0:
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    notebook: str = typer.Argument(..., help="notebook to execute (.ipynb with a tagged parameters cell)"),
    params_file: list[str] = typer.Option([], "-f", "--parameters-file", help="YAML mapping of parameters (repeatable)"),
    reports_dir: str = typer.Option("reports", "--reports-dir", help="where run directories and index.html go"),
    run_id: str = typer.Option("", "--run-id", help="put the notebook into this run directory (default: a new one)"),
    kernel: str = typer.Option("", "--kernel", help="kernel name (default: the notebook's)"),
    log_output: bool = typer.Option(False, "--log-output", help="stream the notebook's output here"),
) -> None:
    """Execute NOTEBOOK with papermill into reports/<run-id>/ (+ HTML, run manifest, index).

    Parameters: -p NAME VALUE (repeatable; values parsed like papermill: int, float, bool, str)."""
    from workbench.reports import NotebookFailed, UnknownParameters, load_parameters, run_notebook

    if not notebook.endswith(".ipynb"):
        _fail(f"{notebook!r} is not a notebook; usage: workbench run NOTEBOOK.ipynb [-p NAME VALUE ...]")
    pairs, extra = [], list(ctx.args)
    while extra:
        flag = extra.pop(0)
        if flag not in ("-p", "--parameters") or len(extra) < 2:
            _fail(f"unexpected argument {flag!r}; parameters are given as -p NAME VALUE")
        pairs.append((extra.pop(0), extra.pop(0)))
    try:
        params = load_parameters(params_file, pairs)
        r = run_notebook(notebook, params, reports_dir, run_id or None, kernel or None,
                         progress_bar=True, log_output=log_output)
    except (UnknownParameters, NotebookFailed, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    typer.echo(f"{r.notebook}: {r.status} in {r.duration_s:.1f}s -> {r.html}")
    if r.figures:
        typer.echo("figures: " + ", ".join(f"{k}={v}" for k, v in r.figures.items()))


@app.command()
def index(reports_dir: str = typer.Option("reports", "--reports-dir")) -> None:
    """Regenerate reports/index.html from the run manifests."""
    from workbench.reports import write_index

    typer.echo(str(write_index(reports_dir)))


@app.command()
def compare(
    run_a: str = typer.Argument(..., help="run id"),
    run_b: str = typer.Argument(..., help="run id"),
    reports_dir: str = typer.Option("reports", "--reports-dir"),
) -> None:
    """Write reports/compare-A-vs-B.html: parameters and key figures side by side, diffs marked."""
    from workbench.reports import compare_runs

    try:
        typer.echo(str(compare_runs(run_a, run_b, reports_dir)))
    except FileNotFoundError as e:
        _fail(str(e))


if __name__ == "__main__":
    app()
