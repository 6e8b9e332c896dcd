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


if __name__ == "__main__":
    app()
